"""hcjax.distill.merge and `python -m hcjax.merge`: exact weighted averages and task vectors on small
trees, the mismatch errors, and a merged checkpoint that the other entry points load."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from hcjax.distill.merge import check_same_tree, task_arithmetic, weighted_average
from hcjax.merge import main
from hcjax.model import ModelConfig, create_sharded
from hcjax.model_io import read_checkpoint, write_checkpoint
from hcjax.sharding import MeshConfig, make_mesh

A = {"w": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "b": {"g": np.array([0.0, 8.0])}}
B = {"w": np.array([[3.0, 6.0], [1.0, 0.0]], np.float32), "b": {"g": np.array([4.0, 0.0])}}


def test_weighted_average_is_exact_and_normalised():
    out = weighted_average([A, B], [1.0, 3.0])  # = 0.25 A + 0.75 B
    np.testing.assert_array_equal(out["w"], [[2.5, 5.0], [1.5, 1.0]])
    np.testing.assert_array_equal(out["b"]["g"], [3.0, 2.0])
    assert out["w"].dtype == np.float32
    same = weighted_average([A, B], [0.25, 0.75])
    np.testing.assert_array_equal(same["w"], out["w"])


def test_task_arithmetic_is_exact():
    base = {"w": np.zeros((2, 2), np.float32), "b": {"g": np.array([1.0, 1.0])}}
    out = task_arithmetic(base, [A, B], [0.5, -1.0])
    # base + 0.5 (A - base) - 1.0 (B - base)
    np.testing.assert_array_equal(out["w"], [[-2.5, -5.0], [0.5, 2.0]])
    np.testing.assert_array_equal(out["b"]["g"], [1 + 0.5 * -1 - 3, 1 + 0.5 * 7 + 1])
    # λ summing to one from the base: the weighted average of the fine-tuned trees.
    np.testing.assert_allclose(task_arithmetic(A, [A, B], [0.5, 0.5])["w"],
                               weighted_average([A, B], [1, 1])["w"])


def test_mismatches_are_named():
    with pytest.raises(ValueError, match=r"param \['w'\] has shape \(3,\)"):
        check_same_tree([A, {"w": np.zeros(3), "b": {"g": np.zeros(2)}}])
    with pytest.raises(ValueError, match="only in tree 1: \\[\"\\['c'\\]\"\\]"):
        weighted_average([A, {**A, "c": np.zeros(1)}], [1, 1])
    with pytest.raises(ValueError, match="weights=\\[1\\] has 1 entries for 2 trees"):
        weighted_average([A, B], [1])
    with pytest.raises(ValueError, match="non-negative"):
        weighted_average([A, B], [1, -1])


def _tiny(**kw):
    fields = dict(vocab_size=272, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=8, d_ff=32, num_experts=2, experts_per_token=1, moe_latent_dim=8,
                  moe_d_ff=16, max_seq_len=32, dtype="float32")
    return ModelConfig(**{**fields, **kw})


def _params(cfg, seed):
    mesh = make_mesh(MeshConfig(num_devices=1))
    model = create_sharded(cfg, mesh, seed=seed)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_merge_cli_writes_a_checkpoint_init_checkpoint_reads(tmp_path):
    cfg = _tiny()
    pa, pb = _params(cfg, 0), _params(cfg, 1)
    write_checkpoint(str(tmp_path / "a"), pa, cfg)
    # The layout climbs wrote before every job saved plain dicts: each param as {"value": array}.
    write_checkpoint(str(tmp_path / "b"), jax.tree.map(lambda x: {"value": x}, pb), cfg)
    out = tmp_path / "merged"
    summary = main(["--checkpoint", str(tmp_path / "a"), "--checkpoint", str(tmp_path / "b"),
                    "--weights", "0.25,0.75", "--output_dir", str(out)])
    assert summary["method"] == "weighted_average"
    assert json.loads((out / "merge.json").read_text())["weights"] == [0.25, 0.75]
    got = read_checkpoint(str(out), model_cfg=cfg, target=pa).params
    want = jax.tree.map(lambda a, b: 0.25 * np.asarray(a) + 0.75 * np.asarray(b), pa, pb)
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(x), y, rtol=1e-6, atol=1e-7)
    # One checkpoint alone is re-written in the sft layout (a climb's params for init_checkpoint).
    main(["--checkpoint", str(tmp_path / "b"), "--output_dir", str(tmp_path / "export")])
    exported = read_checkpoint(str(tmp_path / "export"), model_cfg=cfg, target=pa).params
    for x, y in zip(jax.tree.leaves(exported),
                    jax.tree.leaves(pb), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Task vectors from a base: base + 1.0 (b - base) is b.
    out2 = tmp_path / "tv"
    main(["--checkpoint", str(tmp_path / "b"), "--base", str(tmp_path / "a"),
          "--weights", "1.0", "--output_dir", str(out2)])
    for x, y in zip(jax.tree.leaves(read_checkpoint(str(out2)).params), jax.tree.leaves(pb),
                    strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)


def test_merge_refuses_another_architecture(tmp_path):
    write_checkpoint(str(tmp_path / "a"), _params(_tiny(), 0), _tiny())
    wide = _tiny(d_ff=64)
    write_checkpoint(str(tmp_path / "b"), _params(wide, 0), wide)
    with pytest.raises(ValueError, match="different architectures.*d_ff: 32"):
        main(["--checkpoint", str(tmp_path / "a"), "--checkpoint", str(tmp_path / "b"),
              "--output_dir", str(tmp_path / "m")])


def test_merge_takes_gin_flags_and_writes_its_config(tmp_path):
    cfg = _tiny()
    write_checkpoint(str(tmp_path / "a"), _params(cfg, 0), cfg)
    out = tmp_path / "m"
    main(["--checkpoint", str(tmp_path / "a"), "--output_dir", str(out),
          "--gin_param", "CheckpointConfig.keep = 7"])
    written = (out / "config.gin").read_text()
    assert "# gin params: ['CheckpointConfig.keep = 7']" in written
    assert "CheckpointConfig.keep = 7" in written.split("\n", 2)[2]
    assert (out / "operative_config.gin").is_file()
    with pytest.raises(ValueError, match="--output_dir is required"):
        main(["--checkpoint", str(tmp_path / "a")])
    with pytest.raises(ValueError, match="bad --gin_param"):
        main(["--checkpoint", str(tmp_path / "a"), "--output_dir", str(tmp_path / "x"),
              "--gin_param", "NoSuchThing.x = 1"])
