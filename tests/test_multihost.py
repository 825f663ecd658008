"""What decides a run's exit status when a process may be lost: the error's type and where it was raised,
never its message. (Two real processes: test_train_script.py's pairs and test_checkpoint.py's decisions.)"""

import jax
import jax.numpy as jnp
import pytest

from jaxchat.checkpoint_meta import SaveFailedError
from jaxchat.multihost import decided_by_process_0, gathered, runtime_failure


def raised(make, cause=None):
    try:
        try:
            raise cause if cause is not None else make()
        except BaseException as inner:
            if cause is None:
                raise
            raise make() from inner
    except BaseException as e:  # noqa: BLE001
        return e


def test_a_failed_save_whose_path_says_nccl_is_not_a_lost_peer():
    """ENOSPC from TensorStore under a base directory called .../nccl/...: the run's own failure (exit 74)."""
    tensorstore = ValueError('RESOURCE_EXHAUSTED: Error writing "/data/nccl/run/3/params": No space left on device')
    error = raised(lambda: SaveFailedError("saving checkpoint step 3 in /data/nccl/run failed (Gloo? no)"), tensorstore)
    assert runtime_failure(error) is None


def test_the_runtimes_errors_are_known_by_type_or_by_where_they_were_raised():
    runtime = jax.errors.JaxRuntimeError("INTERNAL: a collective failed")
    assert runtime_failure(raised(lambda: SaveFailedError("saving failed"), runtime)) is not None
    in_jax = raised(lambda: jnp.zeros((2, 3)).reshape(7))  # raised by JAX's own code, as Gloo's all-gather error is
    assert runtime_failure(in_jax) is in_jax
    assert runtime_failure(raised(lambda: ValueError("raised here"))) is None


def test_one_process_decides_and_gathers_alone():
    assert decided_by_process_0("x", lambda: [1, 2]) == [1, 2]
    assert gathered("y", {"ok": True}) == [{"ok": True}]
    with pytest.raises(KeyError):
        decided_by_process_0("z", lambda: {}["missing"])
