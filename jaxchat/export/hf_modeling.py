"""jaxchat's GPT for Hugging Face transformers: copied into every `python -m scripts.export --to-hf DIR` as
DIR/modeling_jaxchat.py, which `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` runs.

It imports only torch and transformers (never jaxchat), so an exported directory works on any machine.
The maths is jaxchat.model.gpt's, nanochat's GPT (nanochat/gpt.py) at the commit of the checkpoint's recipe:
the config carries each difference between recipes as data (value embeddings, smear, backout, q/k scale,
rotary base, the rotary table's dtype, each layer's window), so this file names no recipe. Parameters keep
nanochat's names and PyTorch layout (jaxchat.export.nanochat), vocabulary rows padded to a multiple of 64.

    x   = rms_norm(wte[idx]);  smear: x += smear_lambda sigmoid(smear_gate(x[:24])) x_{t-1}
    x0  = x
    per layer i:  x = resid_lambdas[i] x + x0_lambdas[i] x0
                  x = x + attn_i(rms_norm(x));  x = x + mlp(rms_norm(x))
    backout: x -= backout_lambda x_{after layer n_layer // 2}
    logits = 15 tanh((rms_norm(x) @ lm_head[:vocab].T) / 15)            (float32)

Attention: rotary (first half / second half of the head), QK norm after it, q and k times qk_scale, GQA,
query i sees key j iff 0 <= i - j <= window. A KV cache (transformers' DynamicCache) makes `generate`
feed one token per step; it keeps every key (windows are masks), so it is exact, not a ring buffer.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

LOGIT_SOFTCAP = 15.0
VE_GATE_CHANNELS = 12  # the value-embedding gate reads the first 12 channels of the attention input
VE_GATE_RANGE = 3.0
SMEAR_GATE_CHANNELS = 24  # the smear gate reads the first 24 channels of the normalised embedding
# transformers 5 names the cache of a model output `cache`, 4.x `past_key_values`
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class JaxchatConfig(PretrainedConfig):
    model_type = "jaxchat"
    attribute_map = {"hidden_size": "n_embd", "num_attention_heads": "n_head", "num_hidden_layers": "n_layer",
                     "num_key_value_heads": "n_kv_head", "max_position_embeddings": "sequence_len"}
    recipe: str = "bdcc030"  # the nanochat commit whose GPT this is (informative: the fields below decide)
    sequence_len: int = 2048  # the training length (the rotary table works to 10x it)
    vocab_size: int = 32768  # the tokenizer's tokens; the weights have padded_vocab_size rows
    padded_vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    window_sizes: list | None = None  # per layer: query i sees keys i - window .. i
    value_embed_layers: list | None = None  # the layers with a value embedding (92d63d4)
    smear: bool = False
    backout: bool = False
    qk_scale: float = 1.0
    rotary_base: int = 10000
    rotary_table_bf16: bool = True  # bdcc030 rounds cos/sin to bf16 whatever the dtype; 92d63d4 uses the model's
    tie_word_embeddings: bool = False
    use_cache: bool = True


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm in float32, rounded once to x's dtype; eps is float32's (torch's eps=None)."""
    return F.rms_norm(x.float(), (x.size(-1),), eps=torch.finfo(torch.float32).eps).to(x.dtype)


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, base: int, dtype: torch.dtype):
    """cos, sin of shape (B, t, head_dim/2) for integer positions (B, t), in float32 rounded to dtype."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, t, H, D): y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos over the two halves of D."""
    d = x.shape[-1] // 2
    x1, x2 = x[..., :d], x[..., d:]
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return torch.cat([x1 * cos + x2 * sin, -x1 * sin + x2 * cos], dim=-1)


def scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x if factor == 1.0 else (x.float() * factor).to(x.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: JaxchatConfig, layer: int):
        super().__init__()
        C, H, Hkv = config.n_embd, config.n_head, config.n_kv_head
        self.n_head, self.n_kv_head, self.head_dim, self.layer = H, Hkv, C // H, layer
        self.qk_scale = config.qk_scale
        self.c_q = nn.Linear(C, H * self.head_dim, bias=False)
        self.c_k = nn.Linear(C, Hkv * self.head_dim, bias=False)
        self.c_v = nn.Linear(C, Hkv * self.head_dim, bias=False)
        self.c_proj = nn.Linear(C, C, bias=False)
        has_ve = layer in (config.value_embed_layers or ())
        self.ve_gate = nn.Linear(VE_GATE_CHANNELS, Hkv, bias=False) if has_ve else None

    def forward(self, x, cos, sin, mask, ve, cache):
        B, t, C = x.shape
        q = self.c_q(x).view(B, t, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, t, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, t, self.n_kv_head, self.head_dim)
        if ve is not None:  # value residual, gated per key/value head
            gate = VE_GATE_RANGE * torch.sigmoid(self.ve_gate(x[..., :VE_GATE_CHANNELS]))
            v = v + gate[..., None] * ve.view(B, t, self.n_kv_head, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k = scaled(rms_norm(q), self.qk_scale), scaled(rms_norm(k), self.qk_scale)
        q, k, v = (a.transpose(1, 2) for a in (q, k, v))  # (B, heads, t, D)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        groups = self.n_head // self.n_kv_head  # query head h reads key/value head h // groups
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, t, C))


class MLP(nn.Module):
    def __init__(self, config: JaxchatConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: JaxchatConfig, layer: int):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer)
        self.mlp = MLP(config)


def attention_masks(windows, q_slots, k_slots, key_valid):
    """{window: bool mask (B, 1, t, S)}: query slot q sees key slot k iff 0 <= q - k <= window and k is not
    padding. Every query sees itself, so that a padding query's row is never empty (its softmax would be
    NaN, and a NaN value times a zero weight is still NaN in the rows that read it)."""
    delta = q_slots[:, None] - k_slots[None, :]
    masks = {}
    for window in set(windows):
        allowed = (delta >= 0) & (delta <= window)
        masks[window] = ((allowed[None] & key_valid[:, None, :]) | (delta == 0)[None])[:, None]
    return masks


class JaxchatForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = JaxchatConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["Block"]

    def __init__(self, config: JaxchatConfig):
        super().__init__(config)
        V, C, L = config.padded_vocab_size, config.n_embd, config.n_layer
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(V, C),
                                          "h": nn.ModuleList(Block(config, i) for i in range(L))})
        self.lm_head = nn.Linear(C, V, bias=False)
        self.resid_lambdas = nn.Parameter(torch.ones(L))
        self.x0_lambdas = nn.Parameter(torch.zeros(L))
        ve_dim = config.n_kv_head * (C // config.n_head)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(V, ve_dim) for i in config.value_embed_layers or ()})
        if config.smear:
            self.smear_gate = nn.Linear(SMEAR_GATE_CHANNELS, 1, bias=False)
            self.smear_lambda = nn.Parameter(torch.zeros(1))
        if config.backout:
            self.backout_lambda = nn.Parameter(torch.zeros(1))
        self.post_init()

    def _init_weights(self, module):
        """Nothing: every parameter comes from model.safetensors (this is an exported model, not a recipe to train)."""

    def get_input_embeddings(self):
        return self.transformer["wte"]

    def get_output_embeddings(self):
        return self.lm_head

    def _smear(self, x, previous_input_ids, past, attention_mask):
        """x_t + smear_lambda sigmoid(smear_gate(x_t[:24])) x_{t-1}; nothing where t-1 is before the sequence or padding."""
        if past == 0:
            previous = torch.zeros_like(x[:, :1])
        elif previous_input_ids is None:
            raise ValueError("this model mixes in the previous token's embedding (smear): with a cache, pass "
                             "previous_input_ids, the token before input_ids (generate does so)")
        else:
            previous = rms_norm(self.transformer["wte"](previous_input_ids).to(x.dtype))
        shifted = torch.cat([previous, x[:, :-1]], dim=1)
        if attention_mask is not None:  # the slot before each new token must be a token, not padding
            before = attention_mask[:, past - 1: past + x.shape[1] - 1] if past else F.pad(attention_mask[:, :x.shape[1] - 1], (1, 0))
            shifted = shifted * before[..., None].to(x.dtype)
        gate = self.smear_lambda.to(x.dtype) * torch.sigmoid(self.smear_gate(x[..., :SMEAR_GATE_CHANNELS]))
        return x + gate * shifted

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                use_cache=None, labels=None, previous_input_ids=None, logits_to_keep=0, **kwargs):
        """input_ids (B, t); attention_mask (B, past + t) of 1 (token) and 0 (padding); positions count tokens
        only (left padding works); previous_input_ids (B, 1): the token before input_ids when a cache holds the
        ones before (smear). labels as transformers' (shifted inside, -100 ignored)."""
        config = self.config
        cache = cache if cache is not None else past_key_values
        use_cache = config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        past = cache.get_seq_length() if cache is not None else 0
        B, t = input_ids.shape
        device = input_ids.device
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
            else:
                position_ids = (past + torch.arange(t, device=device)).expand(B, t)
        dtype = self.lm_head.weight.dtype
        cos, sin = rotary_cos_sin(position_ids, config.n_embd // config.n_head, config.rotary_base,
                                  torch.bfloat16 if config.rotary_table_bf16 else dtype)
        key_valid = (attention_mask.bool() if attention_mask is not None
                     else torch.ones(B, past + t, dtype=torch.bool, device=device))
        masks = attention_masks(config.window_sizes, past + torch.arange(t, device=device),
                                torch.arange(past + t, device=device), key_valid)

        x = rms_norm(self.transformer["wte"](input_ids).to(dtype))
        if config.smear:
            x = self._smear(x, previous_input_ids, past, attention_mask)
        x0, x_mid = x, None
        for i, block in enumerate(self.transformer["h"]):
            x = (self.resid_lambdas[i] * x.float() + self.x0_lambdas[i] * x0.float()).to(dtype)
            ve = self.value_embeds[str(i)](input_ids).to(dtype) if str(i) in self.value_embeds else None
            x = x + block.attn(rms_norm(x), cos, sin, masks[config.window_sizes[i]], ve, cache)
            x = x + block.mlp(rms_norm(x))
            if i == config.n_layer // 2:
                x_mid = x
        if config.backout:
            x = x - self.backout_lambda.to(dtype) * x_mid
        x = rms_norm(x)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        z = F.linear(x, self.lm_head.weight[: config.vocab_size]).float()
        logits = LOGIT_SOFTCAP * torch.tanh(z / LOGIT_SOFTCAP)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten().to(device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache if use_cache else None})

    def prepare_inputs_for_generation(self, input_ids, *args, **kwargs):
        """transformers' own, plus the token before the new ones: the smear reads its embedding."""
        inputs = super().prepare_inputs_for_generation(input_ids, *args, **kwargs)
        new = inputs.get("input_ids")
        if self.config.smear and new is not None and new.shape[1] < input_ids.shape[1]:
            start = input_ids.shape[1] - new.shape[1]
            inputs["previous_input_ids"] = input_ids[:, start - 1: start]
        return inputs
