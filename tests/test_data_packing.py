"""First-fit packing: rows reproduce their documents exactly, segment ids / positions restart per
document, masks ride along, and a restored iterator continues with exactly the next batch."""

import grain
import jax
import numpy as np
import pytest

from hcjax.data.packing import FirstFitBins, PackedBatchIterator, build_row
from hcjax.sharding import MeshConfig, batch_sharding, make_mesh
from hcjax.train.pipeline import DataConfig, build_documents, make_batch_iterator, put_on_mesh


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "tokens": rng.integers(16, 272, n).astype(np.int32),
            "loss_mask": rng.integers(0, 2, n).astype(np.int32),
        }
        for n in lengths
    ]


def _unpack(batch):
    """Documents of each row, in order, from segment ids; checks positions restart."""
    out = []
    for r in range(batch["tokens"].shape[0]):
        seg = batch["segment_ids"][r]
        n_segs = int(seg.max())
        assert np.all(seg[seg > 0] == np.sort(seg[seg > 0]))  # contiguous, increasing
        assert np.all(batch["tokens"][r][seg == 0] == 0)
        assert np.all(batch["loss_mask"][r][seg == 0] == 0)
        for s in range(1, n_segs + 1):
            sel = seg == s
            np.testing.assert_array_equal(batch["positions"][r][sel], np.arange(sel.sum()))
            out.append((batch["tokens"][r][sel], batch["loss_mask"][r][sel]))
    return out


def test_first_fit_hand_example():
    bins = FirstFitBins(row_len=10, num_open_bins=2)
    assert bins.add(0, 6) == []  # bin A: [0] (6)
    assert bins.add(1, 5) == []  # does not fit A -> bin B: [1] (5)
    assert bins.add(2, 4) == []  # first fit: A has room (6+4=10) -> A: [0, 2]
    assert bins.add(3, 3) == []  # A full; B: [1, 3] (8)
    assert bins.add(4, 3) == [[0, 2]]  # fits nowhere, 2 bins open -> close oldest (A)
    assert bins.add(5, 2) == []  # B: [1, 3, 5] (10)
    assert bins.flush() == [[1, 3, 5], [4]]


def test_build_row():
    row = build_row(_docs([3, 2]), 8)
    np.testing.assert_array_equal(row["segment_ids"], [1, 1, 1, 2, 2, 0, 0, 0])
    np.testing.assert_array_equal(row["positions"], [0, 1, 2, 0, 1, 0, 0, 0])
    with pytest.raises(ValueError, match="exceed row_len=4"):
        build_row(_docs([3, 2]), 4)


def test_every_document_exactly_once():
    lengths = [int(n) for n in np.random.default_rng(1).integers(1, 17, 200)]
    docs = _docs(lengths)
    it = PackedBatchIterator(grain.MapDataset.source(docs), row_len=16, batch_size=4)
    got = [d for batch in it for d in _unpack(batch)]
    assert len(got) == len(docs)
    # First-fit reorders documents across rows; match them as a multiset.
    key = lambda t: (len(t[0]), tuple(t[0]), tuple(t[1]))  # noqa: E731
    assert sorted(map(key, got)) == sorted(key((d["tokens"], d["loss_mask"])) for d in docs)


def test_packing_is_dense():
    docs = _docs([5] * 300)
    it = PackedBatchIterator(grain.MapDataset.source(docs), row_len=16, batch_size=5)
    batches = list(it)
    used = sum(int((b["segment_ids"] > 0).sum()) for b in batches)
    assert used == 1500
    # Three 5-token documents fill each 16-token row: 100 rows, 20 batches, no padded rows.
    assert len(batches) == 20
    assert all(int(r.max()) == 3 for b in batches for r in b["segment_ids"])


def test_resume_gives_exactly_the_next_batches():
    cfg = DataConfig(row_len=48, num_open_bins=4)
    a = make_batch_iterator(cfg, batch_size=3)
    for _ in range(7):
        next(a)
    state = a.get_state()
    expected = [next(a) for _ in range(5)]
    b = make_batch_iterator(cfg, batch_size=3)
    b.set_state(state)
    for want in expected:
        got = next(b)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_overlong_truncate_and_error():
    docs = _docs([4, 20, 3, 30])
    it = PackedBatchIterator(grain.MapDataset.source(docs), row_len=8, batch_size=8)
    with pytest.warns(UserWarning, match="truncated"):
        batch = next(it)
    assert it.num_truncated == 2
    lens = sorted(len(t) for t, _ in _unpack(batch))
    assert lens == [3, 4, 8, 8]
    it = PackedBatchIterator(
        grain.MapDataset.source(docs), row_len=8, batch_size=8, overlong="error"
    )
    with pytest.raises(ValueError, match="document 1 has 20 tokens > row_len=8"):
        next(it)


def test_bad_arguments():
    ds = grain.MapDataset.source(_docs([3]))
    with pytest.raises(ValueError, match="overlong='drop'"):
        PackedBatchIterator(ds, 8, 2, overlong="drop")
    with pytest.raises(ValueError, match="batch_size=0"):
        PackedBatchIterator(ds, 8, 0)
    with pytest.raises(ValueError, match="empty"):
        PackedBatchIterator(grain.MapDataset.source([]), 8, 2)
    with pytest.raises(ValueError, match="source='web'"):
        DataConfig(source="web")
    with pytest.raises(ValueError, match="needs a path"):
        DataConfig(source="chat_jsonl")


def test_arithmetic_documents_and_epochs(tmp_path):
    cfg = DataConfig(row_len=64, num_train_problems=10, num_epochs=2)
    docs = build_documents(cfg)
    assert len(docs) == 20
    first = sorted(tuple(docs[i]["tokens"]) for i in range(10))
    second = sorted(tuple(docs[i]["tokens"]) for i in range(10, 20))
    assert first == second  # each epoch is a permutation of the same problems
    assert [tuple(docs[i]["tokens"]) for i in range(10)] != [
        tuple(docs[i]["tokens"]) for i in range(10, 20)
    ]  # reshuffled per epoch


def test_put_on_mesh_shards_rows():
    mesh = make_mesh(MeshConfig(data=2, fsdp=-1))
    batch = next(make_batch_iterator(DataConfig(row_len=32), batch_size=8))
    arrays = put_on_mesh(batch, batch_sharding(mesh))
    assert arrays["tokens"].shape == (8, 32)
    assert len(arrays["tokens"].addressable_shards) == len(jax.devices())
    np.testing.assert_array_equal(np.asarray(arrays["tokens"]), batch["tokens"])
    with pytest.raises(ValueError, match="cannot be split"):
        put_on_mesh(next(make_batch_iterator(DataConfig(row_len=32), batch_size=6)),
                    batch_sharding(mesh))


def test_jsonl_sources_through_the_pipeline(tmp_path):
    import json

    from hcjax.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    probs = tmp_path / "p.jsonl"
    probs.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    chats = tmp_path / "c.jsonl"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    chats.write_text(json.dumps({"messages": msgs}) + "\n")
    for source, path, trained in (
        ("problems_jsonl", probs, "<think></think><answer>2</answer><|end|>"),
        ("chat_jsonl", chats, "yo<|end|>"),
    ):
        cfg = DataConfig(source=source, path=str(path), row_len=64, num_epochs=1)
        batch = next(make_batch_iterator(cfg, batch_size=2))
        row = batch["tokens"][0][batch["segment_ids"][0] == 1]
        mask = batch["loss_mask"][0][batch["segment_ids"][0] == 1]
        assert tok.decode(row[mask == 1]) == trained
        assert int(batch["segment_ids"][1].max()) == 0  # one epoch of one document: padded row
