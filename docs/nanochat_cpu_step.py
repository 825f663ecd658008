"""nanochat's train step on the CPU, timed as `python -m scripts.bench train` times jaxchat's: the
comparison behind docs/benchmarks.md's ratio. Not part of jaxchat (it imports nanochat and torch).

    python docs/nanochat_cpu_step.py NANOCHAT_CHECKOUT [--depth 4 --max-seq-len 512
        --device-batch-size 4 --vocab-size 8192 --window-pattern SSSL --steps 10]

NANOCHAT_CHECKOUT is nanochat at commit bdcc030 (`git -C nanochat checkout bdcc030`). What runs is
scripts/base_train.py's step there: GPT built and initialised as base_train builds it, `torch.compile(model,
dynamic=False)`, setup_optimizers (fused AdamW and Muon, whose step is itself compiled), float32 on the CPU
(base_train autocasts only on CUDA), one micro-step per step, then opt.step() and zero_grad. One thing is
replaced: bdcc030 attends with Flash Attention 3 from the HuggingFace hub, a CUDA kernel with no CPU
version; here `flash_attn_func` is torch's scaled_dot_product_attention with FA3's causal sliding-window
mask (key j seen by query i when i - window <= j <= i), the same maths.

Timing: wall clock per optimizer step over `--steps` steps after three warm-up steps (compilation), as
jaxchat.train.step_timing does after its one warm-up call; random tokens.
"""

import argparse
import os
import sys
import time
import types


def flash_attn_func(q, k, v, causal: bool = True, window_size: tuple[int, int] = (-1, 0)):
    """FA3's training call on (B, T, H, D) tensors, as SDPA with its causal sliding-window mask."""
    import torch
    import torch.nn.functional as F

    assert causal and window_size[1] == 0
    T = q.size(1)
    i = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(T, device=q.device)[None, :]
    mask = j <= i
    if window_size[0] >= 0:
        mask = mask & (i - j <= window_size[0])
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       enable_gqa=q.size(2) != k.size(2))
    return y.transpose(1, 2)


def install_flash_attention_stand_in() -> None:
    """nanochat.gpt runs `get_kernel('varunneal/flash-attention-3').flash_attn_interface` at import."""
    interface = types.SimpleNamespace(flash_attn_func=flash_attn_func)
    sys.modules["kernels"] = types.SimpleNamespace(get_kernel=lambda name: types.SimpleNamespace(
        flash_attn_interface=interface))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("nanochat", help="a checkout of nanochat at bdcc030")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--aspect-ratio", type=int, default=64)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--device-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--window-pattern", default="SSSL")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    sys.path.insert(0, os.path.abspath(args.nanochat))
    install_flash_attention_stand_in()
    import torch
    from nanochat.gpt import GPT, GPTConfig

    model_dim = args.depth * args.aspect_ratio
    n_head = max(1, round(model_dim / args.head_dim))  # base_train's find_num_heads where it divides evenly
    assert model_dim % n_head == 0
    config = GPTConfig(sequence_len=args.max_seq_len, vocab_size=args.vocab_size, n_layer=args.depth, n_head=n_head,
                       n_kv_head=n_head, n_embd=model_dim, window_pattern=args.window_pattern)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    model.init_weights()
    compiled = torch.compile(model, dynamic=False)
    optimizers = model.setup_optimizers()
    torch.manual_seed(0)
    shape = (args.device_batch_size, args.max_seq_len)
    x, y = torch.randint(0, args.vocab_size, shape), torch.randint(0, args.vocab_size, shape)

    def step() -> float:
        loss = compiled(x, y)
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        return loss.item()  # base_train's sync point

    for _ in range(3):
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    step_s = (time.perf_counter() - start) / args.steps
    tokens = args.device_batch_size * args.max_seq_len
    print(f"nanochat bdcc030 d{args.depth} T{args.max_seq_len} B{args.device_batch_size} V{args.vocab_size} "
          f"{args.window_pattern} torch {torch.__version__} threads {torch.get_num_threads()}: "
          f"{1e3 * step_s:.1f} ms/step, {tokens / step_s:,.0f} tok/s")


if __name__ == "__main__":
    main()
