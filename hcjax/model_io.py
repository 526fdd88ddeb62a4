"""Models in and out of folders: the run folders every hcjax job writes (params as a plain dict,
whichever job wrote them) and Hugging Face folders. Read
a run's model config and params into a mesh's shardings, write params as a run folder, load a
Hugging Face folder as a model with its source recorded, and convert between the two.

It moves whole models only: a job's own state (optimiser, data iterator, resume) stays with the
job's `hcjax.checkpoint.Checkpointer`, and nothing here trains or samples.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, SingleDeviceSharding
from tqdm import tqdm

from hcjax.checkpoint import CheckpointConfig, Checkpointer, IncompatibleCheckpoint, jsonable
from hcjax.data.byte_hf import BYTE_TOKEN_IDS, write_byte_tokenizer
from hcjax.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from hcjax.model import ModelConfig, Transformer, abstract_model, gguf, hf, param_shardings
from hcjax.model.hf_config import class_defaults, from_hf_config
from hcjax.sharding import MeshConfig, make_mesh

__all__ = [
    "COMPUTE_FIELDS",
    "IMPLEMENTATION_FIELDS",
    "RunCheckpoint",
    "checkpoints_folder",
    "hf_source_meta",
    "hf_to_run",
    "load_hf_model",
    "load_model",
    "model_identity",
    "read_checkpoint",
    "run_to_hf",
    "run_tokenizer",
    "write_checkpoint",
    "resumed_layout_wrapped",
    "wrapped_params_layout",
    "write_model_gin",
]

# Switches of how the model runs, not what it computes (kernel choices, layer scan, remat):
# checkpoints move freely between them, and a Hugging Face folder cannot know which suit this
# machine, so they come from the gin ModelConfig.
IMPLEMENTATION_FIELDS = (
    "moe_impl", "attention_impl", "expert_parallel", "expert_parallel_chunks", "scan_layers",
    "remat_policy",
)

# Recorded with the model but free to differ on reading: the compute dtype (parameters are fp32
# masters whatever it is), so e.g. a bf16 climb starts from a base trained in fp32, and exact
# mode (same weights, another summation order), so an exact climb starts from a default base.
COMPUTE_FIELDS = ("dtype", "batch_invariant", "invariant_tile")


def model_identity(model_cfg: ModelConfig) -> dict[str, Any]:
    """The model config as run folders record it (meta "model_config") and as it is compared on
    reading: every field but the IMPLEMENTATION_FIELDS."""
    return {k: v for k, v in jsonable(model_cfg).items() if k not in IMPLEMENTATION_FIELDS}


# Run folders ------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunCheckpoint:
    """One step of a run's checkpoints: its params (a pure dict of arrays), the ModelConfig its
    meta records (implementation switches from gin) and the meta itself."""

    directory: str  # the run or checkpoints folder, as an absolute path
    step: int
    params: Any
    model_cfg: ModelConfig
    meta: dict[str, Any]

    def identity(self) -> dict[str, Any]:
        return model_identity(self.model_cfg)


def checkpoints_folder(directory: str) -> str:
    """DIRECTORY/checkpoints when DIRECTORY is a run folder, else DIRECTORY itself (a
    checkpoints folder); FileNotFoundError when neither exists."""
    inner = os.path.join(directory, "checkpoints")
    folder = inner if os.path.isdir(inner) else directory
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"checkpoint {directory!r}: no such run or checkpoints folder")
    return folder


def _reader(directory: str) -> Checkpointer:
    return Checkpointer(checkpoints_folder(directory), CheckpointConfig(async_save=False), {})


def _step_and_config(ck: Checkpointer, directory: str, step: int | None
                     ) -> tuple[int, dict[str, Any], ModelConfig]:
    step = ck.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"checkpoint {directory!r}: no checkpoint in {ck.directory!r}")
    meta = ck.read_meta(step)
    if "model_config" not in meta:
        raise ValueError(f"checkpoint {ck.directory!r} step {step} records no model_config")
    # Fields the meta leaves out (the implementation switches) take the gin ModelConfig's.
    return step, meta, ModelConfig(**meta["model_config"])


def _check_identity(written: ModelConfig, model_cfg: ModelConfig, where: str) -> None:
    saved, wanted = model_identity(written), model_identity(model_cfg)
    diff = [f"{k}: checkpoint has {saved.get(k)!r}, run has {wanted.get(k)!r}"
            for k in sorted(set(saved) | set(wanted))
            if saved.get(k) != wanted.get(k) and k not in COMPUTE_FIELDS]
    if diff:
        raise IncompatibleCheckpoint(f"{where} was written by an incompatible model config: "
                                     + "; ".join(diff))


def wrapped_params_layout(ck: Checkpointer, step: int) -> bool:
    """Whether `step` holds its parameters in the layout the climb's learner wrote before every
    job saved plain dicts: each parameter as {"value": array} (an nnx.State as Orbax saves it).
    Nothing writes that layout now; its one reader (`_restore_params`, and the learner's resume)
    is kept so that climb run folders written before the change stay readable (as bases,
    DPO starts, conversions, evaluations, resumed climbs)."""
    node = ck.saved_structure(step).get("params")
    while isinstance(node, dict) and node:
        if set(node) == {"value"} and not isinstance(node["value"], dict):
            return True
        node = next(iter(node.values()))
    return False


def resumed_layout_wrapped(ck: Checkpointer, step: int) -> bool:
    """`wrapped_params_layout` of the step a resume will read: `step`, or where its metadata is
    itself damaged (a latest step that `Checkpointer.restore` will fall back past), the newest
    older step whose metadata reads. One run writes one layout; with no step readable this
    answers the current layout and the restore reports the damage."""
    for s in [step, *sorted((s for s in ck.all_steps() if s < step), reverse=True)]:
        try:
            return wrapped_params_layout(ck, s)
        except Exception:  # noqa: BLE001 - a damaged step; Checkpointer.restore names it
            continue
    return False


def _restore_params(ck: Checkpointer, step: int, target: Any) -> Any:
    if not wrapped_params_layout(ck, step):
        return ck.restore_subtree(step, "params", target)
    wrapped = jax.tree.map(lambda t: {"value": t}, target)
    return jax.tree.map(lambda d: d["value"], ck.restore_subtree(step, "params", wrapped),
                        is_leaf=lambda x: isinstance(x, dict) and set(x) == {"value"})


def _abstract_params(cfg: ModelConfig, mesh: Mesh | None) -> tuple[Any, nnx.State, Any]:
    """(graphdef, abstract state, pure dict of ShapeDtypeStructs): each param placed by the
    logical rules on `mesh`, or on this process's first device when mesh is None."""
    graphdef, abstract = abstract_model(cfg)
    values = nnx.to_pure_dict(abstract)
    if mesh is None:
        here = SingleDeviceSharding(jax.local_devices()[0])
        shardings = jax.tree.map(lambda _: here, values)
    else:
        shardings = nnx.to_pure_dict(param_shardings(abstract, mesh))
    target = jax.tree.map(lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=s),
                          values, shardings)
    return graphdef, abstract, target


def read_checkpoint(directory: str, step: int | None = None, *,
                    model_cfg: ModelConfig | None = None, target: Any = None) -> RunCheckpoint:
    """Step `step` (default the latest) of any hcjax run or checkpoints folder.

    model_cfg: the config the caller runs; its identity must match the recorded one (kernel
    choices and the compute dtype may differ), else IncompatibleCheckpoint names the differing fields. target: a pure
    dict of arrays or ShapeDtypeStructs whose shardings and dtypes the params are read into,
    each device reading only its shards (default: the recorded config's params on this
    process's first device)."""
    ck = _reader(directory)
    try:
        step, meta, written = _step_and_config(ck, directory, step)
        if model_cfg is not None:
            _check_identity(written, model_cfg, f"checkpoint {ck.directory!r} step {step}")
        if target is None:
            target = _abstract_params(model_cfg or written, None)[2]
        params = _restore_params(ck, step, target)
    finally:
        ck.close()
    return RunCheckpoint(os.path.abspath(directory), int(step), params, model_cfg or written,
                         meta)


def load_model(directory: str, mesh: Mesh | None = None, model_cfg: ModelConfig | None = None,
               *, step: int | None = None) -> tuple[Transformer, ModelConfig]:
    """(model, config) with the params of step `step` (default the latest) of any hcjax run,
    read straight into their shardings on `mesh` (default: one device of the gin MeshConfig).
    model_cfg: the config to build (e.g. with other kernel choices; default the recorded one),
    checked against the recorded identity."""
    mesh = mesh if mesh is not None else make_mesh(MeshConfig(num_devices=1))
    ck = _reader(directory)
    try:
        step, _, written = _step_and_config(ck, directory, step)
        cfg = model_cfg or written
        _check_identity(written, cfg, f"checkpoint {ck.directory!r} step {step}")
        graphdef, abstract, target = _abstract_params(cfg, mesh)
        params = _restore_params(ck, step, target)
    finally:
        ck.close()
    state = nnx.State(abstract)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state), cfg


def run_tokenizer(directory: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a run trained with: its Hugging Face source's (the copy under RUN/hf that
    `hf_source_meta` made, else the recorded source folder) when it started from one, else the
    byte tokenizer (every run started from hcjax's own initialisation)."""
    copied = os.path.join(directory, "hf")
    if os.path.isdir(copied):
        return load_tokenizer(copied)
    ck = _reader(directory)
    try:
        _, meta, _ = _step_and_config(ck, directory, None)
    finally:
        ck.close()
    source = meta.get("hf_checkpoint")
    if source is None:
        return ByteTokenizer()
    if not os.path.exists(source):
        raise FileNotFoundError(f"run {directory!r} started from the Hugging Face folder (or "
                                f"GGUF file) {source!r}, which holds its tokenizer and is gone")
    return load_tokenizer(source)


def write_checkpoint(output_dir: str, params: Any, model_cfg: ModelConfig, *, step: int = 0,
                     extra_meta: dict[str, Any] | None = None) -> str:
    """Save `params` (a pure dict) as OUTPUT_DIR/checkpoints step `step` in the layout of an
    hcjax.sft run (meta {"model_config": model_identity, **extra_meta}), which `load_model`,
    the climb's --base_checkpoint and TrainerConfig.init_checkpoint read. Refuses a folder that
    already holds checkpoints. Returns the checkpoints folder."""
    ckpt_dir = os.path.join(os.path.abspath(output_dir), "checkpoints")
    meta = {"model_config": model_identity(model_cfg), **(extra_meta or {})}
    ck = Checkpointer(ckpt_dir, CheckpointConfig(async_save=False), meta)
    try:
        if ck.latest_step() is not None:
            raise FileExistsError(f"{ckpt_dir!r} already holds checkpoints "
                                  f"{ck.all_steps()}; choose an empty output_dir")
        ck.save(step, {"params": params}, force=True)
        ck.wait()
    finally:
        ck.close()
    return ckpt_dir


# Hugging Face folders ---------------------------------------------------------------------------
def load_hf_model(path: str, mesh: Mesh | None = None, *, dtype: str = "float32",
                  **kwargs: Any) -> tuple[Transformer, ModelConfig]:
    """(model, config) of the Hugging Face folder (or `.gguf` file) `path`, parameters born in their shardings on
    `mesh`, with the gin ModelConfig's IMPLEMENTATION_FIELDS. kwargs: `hcjax.model.hf.load`'s
    (progress, report)."""
    gin_cfg = ModelConfig()
    impl = {f: getattr(gin_cfg, f) for f in IMPLEMENTATION_FIELDS}
    return hf.load(path, dtype=dtype, mesh=mesh, **kwargs, **impl)


def hf_source_meta(path: str, output_dir: str) -> dict[str, Any]:
    """Record the Hugging Face folder (or `.gguf` file) a run starts from, so its checkpoints
    export back to one (`run_to_hf`): copies the folder's config and tokenizer files (a GGUF
    file's, as its metadata describes them) into OUTPUT_DIR/hf and returns the checkpoint meta
    entries (its path and config.json)."""
    hf.copy_side_files(path, os.path.join(output_dir, "hf"))
    return {"hf_checkpoint": os.path.abspath(path), "hf_config": hf.read_hf_config(path)}


def _bar(total: int, unit: str, quiet: bool) -> tqdm:
    return tqdm(total=total, unit=unit, disable=quiet, dynamic_ncols=True)


def hf_to_run(src: str, output_dir: str, *, dtype: str = "float32", mesh: Mesh | None = None,
              quiet: bool = False) -> dict[str, Any]:
    """The Hugging Face folder (or `.gguf` file) `src` as a run folder: OUTPUT_DIR/checkpoints (`write_checkpoint`
    with the source recorded, `hf_source_meta`), OUTPUT_DIR/model.gin (its ModelConfig bindings)
    and OUTPUT_DIR/hf (its config and tokenizer files). Parameters stream into their shardings on
    `mesh` (default the gin MeshConfig's). Returns the summary items."""
    t0 = time.perf_counter()
    mesh = mesh if mesh is not None else make_mesh(MeshConfig())
    cfg = from_hf_config(hf.read_hf_config(src), dtype=dtype)
    report = hf.LoadReport()
    with _bar(len(hf.mapping(cfg)), "param", quiet) as bar:  # closed on an error too
        model, cfg = load_hf_model(src, mesh, dtype=dtype, report=report,
                                   progress=lambda name: (bar.set_description(name[-40:]),
                                                          bar.update()))
    t_load = time.perf_counter() - t0
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    source = hf_source_meta(src, output_dir)
    write_checkpoint(output_dir, params, cfg, extra_meta=source)
    write_model_gin(cfg, os.path.join(output_dir, "model.gin"), source=src)
    return {
        "direction": "from_gguf" if gguf.is_gguf(src) else "from_hf",
        "source": os.path.abspath(src),
        "model_type": source["hf_config"].get("model_type"),
        "parameters": sum(int(x.size) for x in jax.tree.leaves(params)),
        "mesh": dict(mesh.shape),
        "load_seconds": t_load,
        "total_seconds": time.perf_counter() - t0,
        "largest_tensor_bytes": report.largest_tensor_bytes,
        "peak_host_bytes": report.peak_host_bytes,
        "peak_host_over_largest_tensor": report.peak_over_largest,
        "skipped_tensors": report.skipped_tensors,
    }


def run_to_hf(src: str, output_dir: str, *, hf_source: str | None = None,
              dtype: str = "float32", max_shard_gb: float = 5.0, quiet: bool = False
              ) -> dict[str, Any]:
    """The latest checkpoint of the hcjax run `src` as a Hugging Face folder transformers loads,
    with the tokenizer the run used: the HF source's files (`hf_source`, else SRC/hf) when it
    started from a Hugging Face model, else the byte tokenizer's Hugging Face form. Returns the
    summary items."""
    t0 = time.perf_counter()
    loaded = read_checkpoint(src)
    cfg, params = loaded.model_cfg, loaded.params
    if hf_source is None and os.path.isdir(os.path.join(src, "hf")):
        hf_source = os.path.join(src, "hf")
    if hf_source is not None:
        base = hf.read_hf_config(hf_source)
    else:
        base = _byte_tokenizer_base(cfg, loaded.meta.get("hf_config"), src)
    graphdef, abstract = abstract_model(cfg)
    state = nnx.State(abstract)
    nnx.replace_by_pure_dict(state, params)
    model = nnx.merge(graphdef, state)
    total = sum(int(x.size) for x in jax.tree.leaves(params))
    with _bar(total * (4 if dtype == "float32" else 2), "B", quiet) as bar:
        hf.save(model, output_dir, hf_config=base, dtype=dtype,
                max_shard_bytes=int(max_shard_gb * 2**30), progress=lambda name, n: bar.update(n))
    if hf_source is not None:
        hf.copy_side_files(hf_source, output_dir, skip=("config.json",))
    else:
        write_byte_tokenizer(output_dir)
    return {
        "direction": "to_hf",
        "source": os.path.abspath(src),
        "step": loaded.step,
        "parameters": total,
        "dtype": dtype,
        "hf_source": hf_source,
        "files": sorted(f for f in os.listdir(output_dir) if f != "convert_logs"),
        "total_seconds": time.perf_counter() - t0,
    }


def _byte_tokenizer_base(cfg: ModelConfig, hf_config: dict | None, src: str) -> dict:
    """config.json keys of a run with no HF source, which was trained with the byte tokenizer:
    its token ids. Refuses a run that started from an HF model (its tokenizer is not ours) or
    whose vocabulary cannot hold the byte tokenizer's ids."""
    if hf_config is not None:
        raise ValueError(
            f"--to_hf {src!r}: the run started from a Hugging Face model "
            f"({hf_config.get('model_type')!r}) but neither --hf_source nor {src}/hf is there to "
            "carry its tokenizer over; pass --hf_source"
        )
    if cfg.vocab_size < ByteTokenizer.vocab_size:
        raise ValueError(
            f"--to_hf {src!r}: the run has no HF source, so its tokenizer is the byte tokenizer "
            f"({ByteTokenizer.vocab_size} ids), but ModelConfig.vocab_size={cfg.vocab_size}; "
            "pass --hf_source with the tokenizer it was trained on"
        )
    return dict(BYTE_TOKEN_IDS)


def write_model_gin(cfg: ModelConfig, path: str, source: str = "") -> None:
    """`ModelConfig` bindings that rebuild `cfg` (pass with --gin_file to sft / climb / serve)."""
    default = ModelConfig(**class_defaults())
    lines = [f"# ModelConfig of {source} (written by hcjax.convert)."]
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if value != getattr(default, field.name):
            lines.append(f"ModelConfig.{field.name} = {value!r}")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
