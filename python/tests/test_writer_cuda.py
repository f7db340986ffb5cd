"""diffrun.writer with torch CUDA tensors: put() does not wait for the caller's stream, and puts inside
torch.cuda.graph capture record every replay. Skips without torch or a CUDA device.

    python3 python/tests/test_writer_cuda.py     # exits 77 (ctest's skip) without torch + CUDA
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from diffrun import writer  # noqa: E402
from diffrun.writer import DumpWriteError  # noqa: E402

if __name__ == "__main__":  # for ctest: skipped (77) with the reason, else pytest on this file
    if importlib.util.find_spec("torch") is None:
        print("skipped: test_writer_cuda needs torch (not installed here)")
        sys.exit(77)
    import torch

    if not torch.cuda.is_available():
        print("skipped: test_writer_cuda needs a CUDA device")
        sys.exit(77)
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", __file__, *sys.argv[1:]]))

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

META = dict(model_path="tiny.gguf", model_fingerprint="1234:0123456789abcdef", arch="llama", n_layer=1, n_embd=8,
            n_head=2, n_head_kv=1, head_dim=4, n_ff=12, n_vocab=32, n_ctx=64, rope_theta=10000.0, rope_type="norm",
            rms_eps=1e-5, tied_output=True, qkv_bias=False, qk_norm=False, prompt="3,5", token_ids=[3, 5])


def test_put_returns_while_the_stream_is_busy(tmp_path):
    out = tmp_path / "async.h5"
    stream = torch.cuda.Stream()
    with writer.open(out, backend="torch-cuda", precision="f32", meta=META) as w, torch.cuda.stream(stream):
        w.step(0)
        w.put("tokens", np.array([3, 5], np.int32))
        x = torch.randn(2, 8, device="cuda")
        # The first launch of a kernel loads its module (CUDA's lazy loading), which may wait for the device:
        # the kernels launched while the stream is busy below are loaded now.
        (x * 2).to(torch.bfloat16)
        expected_x = x.cpu()
        torch.cuda._sleep(400_000_000)  # keeps the stream busy for a while (~0.2 s)
        y = x * 2
        y16 = y.to(torch.bfloat16)
        assert not stream.query(), "the stream is idle before the puts: this test would detect nothing"
        w.put("embd", y)  # the first device put: page-locks the staging buffer (no synchronization)
        w.put("attn_norm-0", y16)
        busy = not stream.query()
    assert busy, "put() waited for the stream"
    with h5py.File(out, "r") as f:
        assert np.array_equal(f["step_0000/embd"][()], expected_x.numpy() * 2)
        bf16 = (expected_x * 2).to(torch.bfloat16).float().numpy()
        assert np.array_equal(f["step_0000/attn_norm-0"][()], bf16)


def test_graph_replays_are_recorded_step_by_step(tmp_path):
    out = tmp_path / "graph.h5"
    w = writer.open(out, backend="torch-cuda", precision="f32", meta=META)
    w.reserve_device(1 << 20)
    w.step(0)
    w.put("tokens", np.array([3, 5], np.int32))
    w.put("embd", np.zeros((2, 8), np.float32))
    w.step(1)
    w.put("tokens", np.array([7], np.int32))
    static_in = torch.zeros(1, 8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static_in * 2 + 1  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = static_in * 2 + 1
        w.put("embd", y)
        w.put("l_out-0", y * 10)
    graph = w.capture_end()
    for step in (1, 2, 3):
        if step > 1:
            w.step(step)
            w.put("tokens", np.array([7], np.int32))
        static_in.fill_(float(step))
        g.replay()
        w.replay(graph)
    with pytest.raises(DumpWriteError, match="recorded twice"):
        w.replay(graph)  # a second launch in the same step
    w.close()
    with h5py.File(out, "r") as f:
        for step in (1, 2, 3):
            assert np.all(f[f"step_{step:04d}/embd"][()] == 2 * step + 1), step
            assert np.all(f[f"step_{step:04d}/l_out-0"][()] == 10 * (2 * step + 1)), step


def test_s_dimension_is_refused_inside_a_capture(tmp_path):
    w = writer.open(tmp_path / "s.h5", backend="torch-cuda", precision="f32", meta=META)
    w.reserve_device(1 << 20)
    w.step(0)
    w.put("tokens", np.array([3, 5], np.int32))
    probs = torch.zeros(2, 2, 2, device="cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(DumpWriteError, match="S dimension"):
        with torch.cuda.graph(g):
            w.put("kq_soft_max-0", probs * 1)
    w.abort()


def test_the_staging_ring_wraps_and_graph_slots_stay_apart(tmp_path):
    """A 4 KiB staging: eager puts wrap around its ring (writing the oldest out when full), a put bigger than the
    whole buffer takes its own pinned memory, and a capture's slots, taken where the ring's pending puts were, do
    not overwrite them."""
    out = tmp_path / "ring.h5"
    w = writer.open(out, backend="torch-cuda", precision="f32", meta=dict(META, prompt="3", token_ids=[3]))
    w.reserve_device(4096)  # 16 slots of 256 bytes
    for step in range(40):
        w.step(step)
        w.put("tokens", torch.tensor([3], device="cuda"))  # int64 on the device: stored int32
        x = torch.full((1, 8), float(step), device="cuda")
        w.put("embd", x)
        w.put("attn_norm-0", (x + 0.5).to(torch.bfloat16))
        if step == 20:  # a foreign name: stored as given, whatever its shape
            w.put("big", torch.arange(2048, dtype=torch.float32, device="cuda").reshape(256, 8))
    pending = len(w._device.pending)
    assert 0 < pending < 3 * 16, pending  # the ring holds at most its 16 slots
    w.step(40)
    w.put("tokens", np.array([7], np.int32))
    static_in = torch.zeros(1, 8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static_in * 2 + 1
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        w.put("embd", static_in * 2 + 1)
    graph = w.capture_end()  # the ring's pending puts are written before the slot can be overwritten
    for step in (40, 41):
        if step > 40:
            w.step(step)
            w.put("tokens", np.array([7], np.int32))
        static_in.fill_(float(step))
        g.replay()
        w.replay(graph)
        y = static_in + 0.25  # an eager put after the capture: in the ring, after the graph slot
        w.put("attn_norm-0", y)
    w.close()
    with h5py.File(out, "r") as f:
        for step in range(40):
            assert np.array_equal(f[f"step_{step:04d}/tokens"][()], [3]), step
            assert np.all(f[f"step_{step:04d}/embd"][()] == step), step
            assert np.all(f[f"step_{step:04d}/attn_norm-0"][()] == step + 0.5), step
        assert np.array_equal(f["step_0020/big"][()], np.arange(2048, dtype=np.float32).reshape(256, 8))
        for step in (40, 41):
            assert np.all(f[f"step_{step:04d}/embd"][()] == 2 * step + 1), step
            assert np.all(f[f"step_{step:04d}/attn_norm-0"][()] == step + 0.25), step
