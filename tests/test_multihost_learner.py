"""The multi-host learner: two JAX processes on 127.0.0.1 (2 CPU devices each, gloo collectives)
train in lockstep on one 4-device mesh and match a single-process learner on 4 devices; the
climb's learner (one device per process, params from a base checkpoint) saves and restores; a
follower whose leader goes silent, aborts or dies stops with an error instead of hanging."""

import json
import os
import socket
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hcjax.checkpoint import CheckpointConfig, Checkpointer
from hcjax.config import cpu_xla_flags
from hcjax.model import create_sharded
from hcjax.model_io import load_model, model_identity
from hcjax.rl.batch import pack_rollouts, to_device
from hcjax.rl.learner import Learner, LearnerConfig
from hcjax.rl.multihost import (
    CommandChannel,
    DistributedLearner,
    _process_shards,
    batch_shardings,
    global_batch,
)
from hcjax.rollout.records import Rollout
from hcjax.sharding import MeshConfig, make_mesh
from tests.test_rl_learner import CFG, _random_rollouts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A large step (and an eps that keeps Adam's update proportional to tiny gradients) so three steps
# move the parameters far more than the comparison tolerance.
LCFG = LearnerConfig(seq_len=16, micro_batches=2, learning_rate=1e-3, adam_eps=1e-6,
                     max_grad_norm=1.0)
STEPS = 3


def _rollouts(seed: int, n: int = 14) -> list[Rollout]:
    return _random_rollouts(n, seed)


def _flat(tree) -> dict[str, np.ndarray]:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def _misplaced(tree, mesh) -> list[str]:
    """Leaves not laid out over every device of `mesh`, or whose per-device buffers are
    malformed (what Orbax's save trips on: `addressable_shards` raises)."""
    bad = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        try:
            shards = x.addressable_shards
        except ValueError as err:
            bad.append(f"{name}: {err}")
            continue
        if set(x.sharding.device_set) != set(mesh.devices.flat):
            bad.append(f"{name}: on devices {sorted(d.id for d in x.sharding.device_set)}")
        elif len(shards) != len(mesh.local_devices):
            bad.append(f"{name}: {len(shards)} local shards")
    return bad


def _save_base(base_dir: str) -> None:
    """A base checkpoint as hcjax.sft writes one (state["params"] a pure dict), from one device."""
    one = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    _, params, _ = nnx.split(create_sharded(CFG, one, seed=1), nnx.Param, ...)
    ckpt = Checkpointer(os.path.join(base_dir, "checkpoints"), CheckpointConfig(async_save=False),
                        {"model_config": model_identity(CFG)})
    try:
        assert ckpt.save(0, {"params": nnx.to_pure_dict(params)}, force=True)
    finally:
        ckpt.close()


def _climb_learner(base_dir: str, mesh) -> Learner:
    """The learner as hcjax.rl.climber.Climb builds it: the base's params restored onto `mesh`
    (hcjax.model_io.load_model via Checkpointer.restore_subtree), then `Learner`."""
    model, _ = load_model(base_dir, mesh, CFG)
    return Learner(model, LCFG, mesh)


# The child processes ---------------------------------------------------------------------------


def _child(scenario: str, coordinator: str, process_id: int, out_dir: str) -> None:
    """One of the two learner processes (run in a subprocess with 2 CPU devices)."""
    jax.distributed.initialize(coordinator, 2, process_id)
    per_process = len(jax.local_devices())
    assert jax.process_count() == 2 and len(jax.devices()) == 2 * per_process
    mesh = make_mesh(MeshConfig(fsdp=2 * per_process))  # every device of both processes
    result: dict = {"process": process_id}
    if scenario == "climb":  # one device per process, as in the two-process climb
        learner = _climb_learner(os.path.join(out_dir, "base"), mesh)
        result["misplaced"] = _misplaced(learner.state, mesh)
        dist = DistributedLearner(learner, timeout_s=300)
        ckpt = Checkpointer(os.path.join(out_dir, "ckpt"), CheckpointConfig(save_every=1, keep=1),
                            {"model": "tiny"})
        if dist.is_leader:
            with dist:
                # Saved before any step, as the climb does when its first steps train nothing.
                result["saved_initial"] = dist.save(ckpt, 0, {"who": "leader"}, force=True)
                result["metrics"] = dist.step(dist.make_batch(_rollouts(0)))
                np.savez(os.path.join(out_dir, "params.npz"), **_flat(dist.host_params()))
                result["saved"] = dist.save(ckpt, 1, {"who": "leader"}, force=True)
                dist.step(dist.make_batch(_rollouts(1)))
                result["restored_data"] = dist.restore(ckpt, 1)
                np.savez(os.path.join(out_dir, "restored.npz"), **_flat(dist.host_params()))
        else:
            result["steps"] = dist.follow(ckpt)
        result["misplaced_after"] = _misplaced(learner.state, mesh)
        ckpt.close()
    elif scenario == "train":
        learner = Learner(create_sharded(CFG, mesh, seed=0), LCFG, mesh)
        dist = DistributedLearner(learner, timeout_s=300)
        ckpt = Checkpointer(os.path.join(out_dir, "ckpt"), CheckpointConfig(save_every=1, keep=1),
                            {"model": "tiny"})
        if dist.is_leader:
            with dist:
                result["metrics"] = [dist.step(dist.make_batch(_rollouts(i)))
                                     for i in range(STEPS)]
                np.savez(os.path.join(out_dir, "params.npz"), **_flat(dist.host_params()))
                result["saved"] = dist.save(ckpt, STEPS, {"who": "leader"}, force=True)
                # One more step, then back to the saved state on both processes.
                dist.step(dist.make_batch(_rollouts(STEPS)))
                result["restored_data"] = dist.restore(ckpt, STEPS)
                local = dist.local_params()
                result["local_devices"] = sorted({d.process_index for x in jax.tree.leaves(local)
                                                  for d in x.sharding.device_set})
                np.savez(os.path.join(out_dir, "restored.npz"), **_flat(jax.device_get(local)))
        else:
            result["steps"] = dist.follow(ckpt)
        ckpt.close()
    else:  # failures: a stand-in learner (only the mesh and a parameter are used)
        x = jax.make_array_from_callback(
            (4, 2), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")),
            lambda index: np.arange(8, dtype=np.float32).reshape(4, 2)[index])
        stub = types.SimpleNamespace(mesh=mesh, state=types.SimpleNamespace(params={"w": x}))
        silent = DistributedLearner(stub, timeout_s=2.0, name="silent")
        aborting = DistributedLearner(stub, timeout_s=60.0, name="aborting")
        if silent.is_leader:
            result["gathered"] = silent.host_params()["w"].tolist()
            if scenario == "kill":
                os._exit(3)  # the leader process dies without a word
            # The leader goes silent on `silent` (no stop); `aborting` fails inside its block.
            try:
                with aborting:
                    raise ValueError("boom in the controller")
            except ValueError:
                pass
        else:
            for name, dist in (("silent", silent), ("aborting", aborting)):
                t0 = time.perf_counter()
                try:
                    dist.follow()
                    result[name] = {"error": None}
                except Exception as err:  # recorded for the test to check
                    result[name] = {"error": type(err).__name__, "message": str(err),
                                    "seconds": time.perf_counter() - t0}
    with open(os.path.join(out_dir, f"result{process_id}.json"), "w") as f:
        json.dump(result, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario: str, out_dir: str, devices_per_process: int = 2) -> list[subprocess.Popen]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               XLA_FLAGS=cpu_xla_flags(devices_per_process))
    coordinator = f"127.0.0.1:{_free_port()}"
    procs = []
    for pid in range(2):
        code = (f"from tests.test_multihost_learner import _child; "
                f"_child({scenario!r}, {coordinator!r}, {pid}, {out_dir!r})")
        log = open(os.path.join(out_dir, f"log{pid}.txt"), "w")
        procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait(procs, out_dir: str, timeout: float) -> tuple[list, str]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            codes.append(None)
    logs = "\n".join(f"--- process {i}:\n" + open(os.path.join(out_dir, f"log{i}.txt")).read()[-3000:]
                     for i in range(len(procs)))
    assert None not in codes, f"a learner process hung (return codes {codes})\n{logs}"
    return codes, logs


def _result(out_dir: str, pid: int) -> dict:
    with open(os.path.join(out_dir, f"result{pid}.json")) as f:
        return json.load(f)


# Tests -----------------------------------------------------------------------------------------


def test_host_batch_places_like_to_device():
    """One process: the per-process blocks rebuild exactly `to_device`'s global batch."""
    mesh = make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    packed = pack_rollouts(_rollouts(0), seq_len=16, micro_batches=2, row_multiple=4)
    ref = to_device(packed, mesh)
    fields = {n: getattr(packed, n) for n in packed.__dataclass_fields__}
    shapes = {n: np.shape(x) for n, x in fields.items() if x is not None}
    shardings = batch_shardings(shapes, mesh)
    blocks = {n: (None if x is None else _process_shards(np.asarray(x), shardings[n])[0])
              for n, x in fields.items()}
    assert len(blocks["tokens"]) == 4  # 4 row blocks (data x fsdp), replicated over tensor
    got = global_batch(blocks, shapes, {n: np.asarray(x).dtype for n, x in fields.items()
                                        if x is not None}, shardings)
    for name in fields:
        a, b = getattr(got, name), getattr(ref, name)
        if b is None:  # an optional field the batch does not carry (LearnerBatch.fresh)
            assert a is None, name
            continue
        assert a.sharding == b.sharding, name
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_single_process_distributed_learner_is_the_learner():
    mesh = make_mesh(MeshConfig(fsdp=4), devices=jax.devices()[:4])
    learner = Learner(create_sharded(CFG, mesh, seed=0), LCFG, mesh)
    start = jax.tree.map(jnp.copy, learner.state)
    want = learner.step(learner.make_batch(_rollouts(0)))
    want_params = _flat(jax.device_get(learner.state.params))
    learner.state = start
    dist = DistributedLearner(learner)
    assert dist.is_leader and dist.data_parallel_size == 4 and dist.cfg is LCFG
    batch = dist.make_batch(_rollouts(0))
    assert isinstance(batch.tokens, np.ndarray)  # packed on the host; `step` places it
    assert dist.step(batch) == want
    # The host path lays the batch out as to_device does: the step did not compile again.
    assert learner._step._cache_size() == 1
    got = _flat(dist.host_params())
    assert all(isinstance(x, np.ndarray) for x in got.values())
    for name, x in got.items():
        np.testing.assert_array_equal(x, want_params[name], err_msg=name)
    with pytest.raises(TypeError, match="host"):
        dist.step(learner.make_batch(_rollouts(1)))
    # The controller's step, as Learner.train: bucketed rows packed on the host, then `step`.
    assert dist.train([]) == {"skipped": 1.0}
    metrics = dist.train(_rollouts(1))
    assert metrics["rows"] == learner.pack_bucketed(_rollouts(1)).rows
    assert metrics["train_rollouts"] == 14 and np.isfinite(metrics["loss"])
    dist.stop()
    with pytest.raises(RuntimeError, match="after stop"):
        dist.host_params()


def test_learner_state_is_born_on_its_mesh(tmp_path):
    """Every leaf of a new learner's state lives on the learner mesh (none built on one device
    and moved, which a mesh over several processes cannot take): Adam's moments sharded like
    their parameters, the scalars replicated, also when the params come from a base checkpoint
    as in the climb."""
    mesh = make_mesh(MeshConfig(fsdp=4), devices=jax.devices()[:4])
    _save_base(str(tmp_path / "base"))
    for learner in (Learner(create_sharded(CFG, mesh, seed=0), LCFG, mesh),
                    _climb_learner(str(tmp_path / "base"), mesh)):
        state = learner.state
        assert _misplaced(state, mesh) == []
        param_shardings = jax.tree.leaves(jax.tree.map(lambda x: x.sharding, state.params))
        assert any(s.spec != jax.sharding.PartitionSpec() for s in param_shardings)
        adam = state.opt_state[1][0]  # clip_by_global_norm, then AdamW's ScaleByAdamState
        for moments in (adam.mu, adam.nu):
            assert jax.tree.leaves(jax.tree.map(lambda x: x.sharding, moments)) == param_shardings
        for scalar in (adam.count, state.step, state.entropy["k"]):
            assert scalar.shape == () and scalar.sharding.spec == jax.sharding.PartitionSpec()
        assert int(state.step) == 0 and float(state.entropy["k"]) == np.float32(LCFG.entropy.k)
    # The climb's learner starts from the base's params, not a fresh init.
    one = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    base = _flat(nnx.to_pure_dict(nnx.state(create_sharded(CFG, one, seed=1), nnx.Param)))
    got = _flat(nnx.to_pure_dict(learner.state.params))
    assert sorted(got) == sorted(base)
    for name, x in got.items():
        np.testing.assert_array_equal(x, base[name], err_msg=name)


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="timeout_s=0"):
        CommandChannel(timeout_s=0)
    mesh = make_mesh(MeshConfig(fsdp=1), devices=jax.devices()[:1])
    with pytest.raises(ValueError, match="timeout_s=-1"):
        DistributedLearner(types.SimpleNamespace(mesh=mesh), timeout_s=-1)
    with pytest.raises(RuntimeError, match="only the other processes follow"):
        DistributedLearner(types.SimpleNamespace(mesh=mesh)).follow()


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    out = str(tmp_path)
    procs = _launch("train", out)
    # The single-process reference on 4 devices, computed while the two processes start.
    mesh = make_mesh(MeshConfig(fsdp=4), devices=jax.devices()[:4])
    ref = Learner(create_sharded(CFG, mesh, seed=0), LCFG, mesh)
    init = _flat(jax.device_get(ref.state.params))
    ref_metrics = [ref.step(ref.make_batch(_rollouts(i))) for i in range(STEPS)]
    ref_params = _flat(jax.device_get(ref.state.params))
    codes, logs = _wait(procs, out, timeout=400)
    assert codes == [0, 0], logs
    leader, follower = _result(out, 0), _result(out, 1)
    assert follower["steps"] == STEPS + 1 and leader["saved"] is True
    assert leader["restored_data"] == {"who": "leader"} and leader["local_devices"] == [0]

    for step, (got, want) in enumerate(zip(leader["metrics"], ref_metrics, strict=True)):
        for key in ("loss", "entropy", "policy_loss", "grad_norm", "k_next"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6,
                                       err_msg=f"step {step} {key}")
    with np.load(os.path.join(out, "params.npz")) as npz:
        got = {k: npz[k] for k in npz.files}
    assert sorted(got) == sorted(ref_params)
    moved = max(float(np.max(np.abs(ref_params[k] - init[k]))) for k in init)
    assert moved > 1e-3  # the three steps changed the parameters well beyond the tolerance
    for name, want in ref_params.items():
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-5, err_msg=name)
    with np.load(os.path.join(out, "restored.npz")) as npz:  # restored after a 4th step
        for name in npz.files:
            np.testing.assert_array_equal(npz[name], got[name], err_msg=name)

    # The checkpoint written by both processes restores (here on one process) to those params,
    # with the leader's data.
    ckpt = Checkpointer(os.path.join(out, "ckpt"), CheckpointConfig(save_every=1, keep=1),
                        {"model": "tiny"})
    try:
        data = ref.restore(ckpt, STEPS)
    finally:
        ckpt.close()
    state = ref.state
    assert data == {"who": "leader"} and int(state.step) == STEPS
    for name, x in _flat(jax.device_get(state.params)).items():
        np.testing.assert_allclose(x, ref_params[name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.slow
def test_climbs_learner_over_two_one_device_processes_saves_and_restores(tmp_path):
    """The learner as the two-process climb builds it (one CPU device per process, params from a
    base checkpoint): every state leaf is a well-formed global array, and it trains, checkpoints
    (Orbax writes each process's shards) and restores like a single-process learner."""
    out = str(tmp_path)
    _save_base(os.path.join(out, "base"))
    procs = _launch("climb", out, devices_per_process=1)
    mesh = make_mesh(MeshConfig(fsdp=2), devices=jax.devices()[:2])
    ref = _climb_learner(os.path.join(out, "base"), mesh)
    ref_metrics = ref.step(ref.make_batch(_rollouts(0)))
    ref_params = _flat(jax.device_get(ref.state.params))
    codes, logs = _wait(procs, out, timeout=400)
    assert codes == [0, 0], logs
    leader, follower = _result(out, 0), _result(out, 1)
    for result in (leader, follower):
        assert result["misplaced"] == [] and result["misplaced_after"] == [], result
    assert leader["saved_initial"] is True and leader["saved"] is True and follower["steps"] == 2
    assert leader["restored_data"] == {"who": "leader"}
    for key in ("loss", "entropy", "policy_loss", "grad_norm", "k_next"):
        np.testing.assert_allclose(leader["metrics"][key], ref_metrics[key], rtol=1e-5, atol=1e-6,
                                   err_msg=key)
    with np.load(os.path.join(out, "params.npz")) as npz:
        saved = {k: npz[k] for k in npz.files}
    assert sorted(saved) == sorted(ref_params)
    for name, want in ref_params.items():
        np.testing.assert_allclose(saved[name], want, rtol=1e-5, atol=1e-5, err_msg=name)
    with np.load(os.path.join(out, "restored.npz")) as npz:  # restored after a second step
        for name in npz.files:
            np.testing.assert_array_equal(npz[name], saved[name], err_msg=name)
    # The checkpoint both processes wrote restores here, on one process, to the same state.
    ckpt = Checkpointer(os.path.join(out, "ckpt"), CheckpointConfig(save_every=1, keep=1),
                        {"model": "tiny"})
    try:
        data = ref.restore(ckpt, 1)
    finally:
        ckpt.close()
    state = ref.state
    assert data == {"who": "leader"} and int(state.step) == 1
    for name, x in _flat(jax.device_get(state.params)).items():
        np.testing.assert_array_equal(x, saved[name], err_msg=name)


@pytest.mark.slow
def test_follower_of_a_silent_or_failed_leader_raises(tmp_path):
    out = str(tmp_path)
    t0 = time.perf_counter()
    codes, logs = _wait(_launch("failures", out), out, timeout=120)
    assert codes == [0, 0], logs
    leader, follower = _result(out, 0), _result(out, 1)
    assert leader["gathered"] == np.arange(8).reshape(4, 2).tolist()
    silent = follower["silent"]
    assert silent["error"] == "CommandTimeout", silent
    assert "waited 2s for command 1" in silent["message"] and "'gather'" in silent["message"]
    assert 1.5 < silent["seconds"] < 30
    aborted = follower["aborting"]
    assert aborted["error"] == "LeaderAborted", aborted
    assert "ValueError: boom in the controller" in aborted["message"]
    assert time.perf_counter() - t0 < 120


@pytest.mark.slow
def test_follower_of_a_dead_leader_process_exits(tmp_path):
    # When the leader's process dies, the jax.distributed service (hosted by process 0) is gone
    # and JAX terminates the follower at once: it does not wait for the command timeout.
    out = str(tmp_path)
    codes, logs = _wait(_launch("kill", out), out, timeout=120)
    assert codes[0] == 3 and codes[1] != 0, logs
    assert "JAX distributed service detected fatal errors" in logs
    assert not os.path.exists(os.path.join(out, "result1.json"))


def test_the_inference_process_cannot_join_the_learners_distributed_job(capsys):
    # Inference replicas are separate processes (`hcjax.serve`); the learner's
    # jax.distributed flags belong to `hcjax.climb` only, and serve refuses them.
    from hcjax.serve import main

    with pytest.raises(SystemExit) as info:
        main(["--coordinator_address", "127.0.0.1:1"])
    assert info.value.code == 2
    assert "unrecognized arguments: --coordinator_address" in capsys.readouterr().err
