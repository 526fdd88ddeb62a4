"""hcjax: an asynchronous RL post-training system for MoE models in JAX."""

import glob
import importlib.util
import os

from hcjax.host_memory import apply_from_environment as _apply_host_malloc

# HCJAX_HOST_MALLOC=keep: freed heap pages stay with the process (hcjax/host_memory.py), set
# before JAX starts its threads.
_apply_host_malloc()

_GPU_PLUGINS = {"jax_cuda12_plugin": "cuda", "jax_cuda13_plugin": "cuda",
                "jax_rocm60_plugin": "rocm", "jax_rocm7_plugin": "rocm"}


def _default_jax_platforms() -> None:
    """libtpu is installed only for the planner's compile-only TPU devices (hcjax.plan, which
    needs no TPU backend), yet JAX initialises it on every start: on a host without TPU chips
    that prints libtpu's warnings and takes its lockfile, so a planner started beside a climb
    fails. Unless JAX_PLATFORMS is set, a host with no TPU device files runs JAX on its GPUs
    (when a JAX GPU plugin is installed and a GPU device file exists) and on CPU."""
    if os.environ.get("JAX_PLATFORMS"):
        return
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return  # a TPU host: JAX's own choice
    gpus = {kind for name, kind in _GPU_PLUGINS.items() if importlib.util.find_spec(name)}
    if gpus and (glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd")):
        os.environ["JAX_PLATFORMS"] = ",".join(sorted(gpus)) + ",cpu"
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"


_default_jax_platforms()
