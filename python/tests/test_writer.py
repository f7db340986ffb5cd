"""diffrun.writer and diffrun.fingerprint, checked against the C++ side: its dumps, `diffrun compare`, `diffrun inspect`.

Needs DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR (ctest sets them); the SmolLM2 fingerprint needs the fetched model.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

import diffrun
from diffrun import writer
from diffrun.fingerprint import GgufError, data_offset, fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import dump_h5  # noqa: E402  (plain-h5py edits of the attribute table)

BIN = os.environ.get("DIFFRUN_BIN", "")
FIXTURES = Path(os.environ.get("DIFFRUN_FIXTURE_DIR", ""))


def need_cpp():
    if not BIN or not FIXTURES.is_dir():
        pytest.fail("DIFFRUN_BIN and DIFFRUN_FIXTURE_DIR must be set (run through ctest)")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An f64 CPU reference dump of the tiny qwen3 fixture (prefill + 2 decode steps), by the C++ writer."""
    need_cpp()
    out = tmp_path_factory.mktemp("ref") / "reference.h5"
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f64", "--model",
                    str(FIXTURES / "tiny-qwen3-f32.gguf"), "--tokens", "1,5,9,13", "--steps", "2", "--out", str(out)],
                   check=True, capture_output=True)
    return out


def copy_dump(src: Path, dst: Path, change=None, **kwargs) -> None:
    """Writes every checkpoint of src again through diffrun.writer, optionally changed by change(step, name, a)."""
    with diffrun.open(src) as ref, writer.open(dst, backend="python", precision="f32", like=ref, **kwargs) as w:
        for step in ref.steps():
            w.step(step)
            for name in ref.names(step):
                a = ref.get(name, step)
                w.put(name, change(step, name, a) if change else a)


def compare(a: Path, b: Path, tmp_path: Path) -> tuple[int, dict]:
    report = tmp_path / "report.json"
    r = subprocess.run([BIN, "compare", str(a), str(b), "--report-json", str(report), "--no-color"],
                       capture_output=True, text=True)
    assert r.returncode in (0, 1), r.stdout + r.stderr
    return r.returncode, json.loads(report.read_text())


def test_copy_of_a_reference_compares_clean(reference, tmp_path):
    out = tmp_path / "copy.h5"
    copy_dump(reference, out)
    assert not list(tmp_path.glob("*tmp-*"))
    rc, report = compare(out, reference, tmp_path)
    assert rc == 0, report
    r = subprocess.run([BIN, "ls", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and "python" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("model", ["tiny-qwen2moe-f32.gguf", "tiny-mixtral-f32.gguf"])
def test_copy_of_a_mixture_of_experts_compares_clean(model, tmp_path):
    """like= lends a mixture of experts' sizes too (n_expert, n_expert_used, n_ff_exp), and the writer takes the
    routing kinds of an arch that has them (qwen2moe) or of a llama whose n_expert says so (Mixtral): the reference's
    [T, E], [T, K] and [T, K, Fe] checkpoints are written again and compare clean, every one of them."""
    need_cpp()
    ref, out = tmp_path / "moe.h5", tmp_path / "copy.h5"
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f64", "--model", str(FIXTURES / model),
                    "--tokens", "1,5,9", "--steps", "1", "--out", str(ref)], check=True, capture_output=True)
    copy_dump(ref, out)
    with diffrun.open(ref) as r, diffrun.open(out) as c:
        for key in ("n_expert", "n_expert_used", "n_ff_exp"):
            assert c.meta[key] == r.meta[key], key
        assert {"ffn_moe_topk-1", "ffn_moe_gate-1"} <= set(c.names(1))
        assert c.names(1) == r.names(1)  # in the vocabulary's order
    rc, report = compare(out, ref, tmp_path)
    assert rc == 0, report
    assert report["coverage"]["percent"] == 100.0


def test_a_changed_checkpoint_is_the_first_divergence(reference, tmp_path):
    out = tmp_path / "changed.h5"

    def change(step, name, a):
        return a * np.float32(1.01) if (step, name) == (1, "ffn_up-1") else a

    copy_dump(reference, out, change)
    rc, report = compare(out, reference, tmp_path)
    assert rc == 1
    assert "ffn_up-1" in json.dumps(report.get("first_divergence", report))
    first = report["first_divergence"]
    assert first["name"] == "ffn_up-1" and first["step"] == 1


def test_root_attributes_have_the_cpp_writers_types(reference, tmp_path):
    out = tmp_path / "copy.h5"
    copy_dump(reference, out)

    def type_signature(t):
        if isinstance(t, h5py.h5t.TypeStringID):  # fixed-length, sized to the value: the size is not compared
            return [type(t).__name__, "vlen" if t.is_variable_str() else "fixed", t.get_cset(), t.get_strpad()]
        sig = [type(t).__name__, t.get_size()]
        if isinstance(t, h5py.h5t.TypeEnumID):
            sig.append([t.get_member_name(i) for i in range(t.get_nmembers())])
        if isinstance(t, h5py.h5t.TypeCompoundID):
            sig.append([(t.get_member_name(i), type_signature(t.get_member_type(i))) for i in range(t.get_nmembers())])
        return sig

    def signature(attrs, key):
        return type_signature(attrs.get_id(key).get_type()), attrs.get_id(key).shape

    with h5py.File(reference) as r, h5py.File(out) as p:
        for key in writer.ROOT_ATTRIBUTES:
            assert signature(p.attrs, key) == signature(r.attrs, key), key
            t = p.attrs.get_id(key).get_type()
            if isinstance(t, h5py.h5t.TypeStringID):
                assert not t.is_variable_str() and t.get_size() == max(1, len(p.attrs[key])), key
        for key in ("model_fingerprint", "arch", "n_layer", "rope_theta", "qk_norm", "prompt"):
            assert p.attrs[key] == r.attrs[key]
        assert list(p.attrs["token_ids"]) == list(r.attrs["token_ids"])
        assert p.attrs["backend"] == b"python" and p.attrs["precision"] == b"f32"
        # the attribute tables: the same columns and types, the same rows but native_dtype
        pt, rt = p["step_0001/_attributes"], r["step_0001/_attributes"]
        assert type_signature(pt.id.get_type()) == type_signature(rt.id.get_type())
        prow = {row["name"]: row for row in pt[()]}
        rrow = {row["name"]: row for row in rt[()]}
        for name in (b"tokens", b"Qnorm-0", b"kq_soft_max-1", b"result_output"):
            for key in ("order", "layer", "layout", "row_offset", "dtype"):
                assert prow[name][key] == rrow[name][key], (name, key)
        for name in ("tokens", "Qnorm-0", "kq_soft_max-1", "result_output"):
            assert len(p["step_0001"][name].attrs) == 0
            assert p["step_0001"][name].dtype == r["step_0001"][name].dtype
            assert p["step_0001"][name].chunks is None


def meta_numbers():
    return dict(model_path="m.gguf", model_fingerprint="1:0", arch="llama", n_layer=1, n_embd=4, n_head=2,
                n_head_kv=1, head_dim=2, n_ff=8, n_vocab=10, n_ctx=16, rope_theta=10000.0, rope_type="norm",
                rms_eps=1e-5, tied_output=False, qkv_bias=False, qk_norm=False, prompt="", token_ids=[1, 2])


def test_dtypes_native_names_and_keep_dtype(tmp_path):
    x = np.linspace(-2, 2, 8, dtype=np.float32).reshape(2, 4)
    bf16 = writer.f32_to_bf16(x)
    with writer.open(tmp_path / "a.h5", backend="numpy", precision="f16", meta=meta_numbers()) as w:
        w.step(0)
        w.put("tokens", np.array([1, 2]))  # int64 ids become int32
        w.put("embd", x.astype(np.float16))
        w.put("attn_norm-0", bf16)
        w.put("attn_out-0", x.astype(np.float64))
        w.put("Qcur-0", x)  # [T, H*Dh] is stored [T, H, Dh]
        w.set_attribute("argmax", [3])  # one id per step
        w.set_attribute("device", "laptop")
    with diffrun.open(tmp_path / "a.h5") as d:
        assert d.get("tokens").dtype == np.int32 and d.info("tokens").native_dtype == "i32"
        assert [d.info(n).native_dtype for n in ("embd", "attn_norm-0", "attn_out-0", "Qcur-0")] == \
            ["f16", "bf16", "f64", "f32"]
        assert all(d.get(n).dtype == np.float32 for n in ("embd", "attn_norm-0", "attn_out-0"))
        np.testing.assert_array_equal(d.get("attn_norm-0"), writer.bf16_to_f32(bf16))
        assert d.get("Qcur-0").shape == (2, 2, 2) and d.info("Qcur-0").layout == "T,H,Dh"
        assert d.names(0) == ["tokens", "embd", "attn_norm-0", "Qcur-0", "attn_out-0"]
        assert list(d.meta["argmax"]) == [3] and d.meta["device"] == "laptop"
    with writer.open(tmp_path / "b.h5", backend="numpy", precision="bf16", meta=meta_numbers(), keep_dtype=True) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        w.put("embd", x.astype(np.float16))
        w.put("attn_norm-0", bf16)
        w.put("attn_out-0", x.astype(np.float64))
    with h5py.File(tmp_path / "b.h5") as f:
        g = f["step_0000"]
        assert (g["embd"].dtype, g["attn_norm-0"].dtype, g["attn_out-0"].dtype) == (np.float16, np.uint16, np.float64)
        table = {row["name"]: row for row in g["_attributes"][()]}
        assert table[b"attn_norm-0"]["dtype"] == b"bf16" and table[b"embd"]["dtype"] == b""
    with diffrun.open(tmp_path / "b.h5") as d:
        np.testing.assert_array_equal(d.get("attn_norm-0"), writer.bf16_to_f32(bf16))
        assert d.get("attn_out-0").dtype == np.float64


def test_bf16_rounding_matches_a_reference_rounding():
    x = np.array([1.0, 1.00390625, 1.01171875, -3.5e-3, 65504.0, np.inf, -np.inf, 1e-40], np.float32)
    b = writer.f32_to_bf16(x)
    back = writer.bf16_to_f32(b)
    # round-to-nearest-even to 8 significant bits
    np.testing.assert_array_equal(back[:3], np.array([1.0, 1.0, 1.015625], np.float32))
    assert np.isinf(back[5]) and back[5] > 0 and np.isinf(back[6]) and back[6] < 0
    assert np.isnan(writer.bf16_to_f32(writer.f32_to_bf16(np.array([np.nan], np.float32))))[0]
    assert abs(back[3] - x[3]) <= abs(x[3]) * 2 ** -8


def test_an_exception_leaves_no_file(tmp_path):
    path = tmp_path / "x.h5"
    with pytest.raises(RuntimeError):
        with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
            w.put("tokens", np.array([1, 2], np.int32))
            w.put("embd", np.zeros((2, 4), np.float32))
            raise RuntimeError("engine crashed")
    assert list(tmp_path.iterdir()) == []


def test_the_temporary_is_created_exclusively_never_through_a_symlink(tmp_path):
    path = tmp_path / "x.h5"
    tmp = Path(f"{path}{writer.TEMP_INFIX}{os.getpid()}")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.mkfifo(tmp_path / "fifo")
    for target in (victim, tmp_path / "nowhere", tmp_path / "fifo"):
        tmp.symlink_to(target)
        with pytest.raises(writer.DumpWriteError, match="it exists and is a symbolic link"):
            writer.open(path, backend="numpy", precision="f32", meta=meta_numbers())
        assert tmp.is_symlink() and not path.exists()
        tmp.unlink()
    assert victim.read_text() == "precious" and not (tmp_path / "nowhere").exists()
    # A regular file there is a killed writer's leftover (its pid now ours): replaced.
    tmp.write_text("a killed run's bytes")
    with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
        w.put("tokens", np.array([1, 2], np.int32))
    assert diffrun.open(path).steps() == [0] and not tmp.exists()


def test_a_dump_written_over_an_older_one_replaces_it(tmp_path):
    path = tmp_path / "x.h5"
    for tokens in ([1, 2], [3, 4, 5]):
        with writer.open(path, backend="numpy", precision="f32", meta={**meta_numbers(), "token_ids": tokens}) as w:
            w.put("tokens", np.array(tokens, np.int32))
        if tokens == [1, 2]:
            old = open(path, "rb")  # the old file, held: it stays readable, never written over in place
            old_bytes = old.read()
    assert diffrun.open(path).get("tokens").tolist() == [3, 4, 5]
    old.seek(0)
    assert old.read() == old_bytes
    old.close()
    assert [p.name for p in tmp_path.iterdir()] == ["x.h5"]


def test_an_existing_non_regular_path_is_refused_not_replaced(tmp_path):
    os.mkfifo(tmp_path / "fifo.h5")
    (tmp_path / "null.h5").symlink_to("/dev/null")
    for name, what in (("fifo.h5", "is a FIFO"), ("null.h5", "is a character device"), (".", "is a directory")):
        with pytest.raises(writer.DumpWriteError, match=f"exists and {what}"):
            writer.open(tmp_path / name, backend="numpy", precision="f32", meta=meta_numbers())
    assert (tmp_path / "fifo.h5").is_fifo() and (tmp_path / "null.h5").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.h5", "null.h5"]


_SCRIPT = """
import sys, time
import numpy as np
from diffrun import writer
meta = dict(model_path="m.gguf", model_fingerprint="1:0", arch="llama", n_layer=2, n_embd=256, n_head=4, n_head_kv=2,
            head_dim=64, n_ff=512, n_vocab=1000, n_ctx=64, rope_theta=10000.0, rope_type="norm", rms_eps=1e-5,
            tied_output=False, qkv_bias=False, qk_norm=False, prompt="", token_ids=[1, 2, 3])
with writer.open(sys.argv[1], backend="numpy", precision="f32", meta=meta) as w:
    w.put("tokens", np.array([1, 2, 3], np.int32))
    if sys.argv[2] == "sleep":
        print("ready", flush=True)
        time.sleep(60)
    try:
        for s in range(1, 2000):
            w.step(s)
            w.put("tokens", np.array([4], np.int32))
            w.put("result_output", np.ones((1, 1000), np.float32))
            for layer in range(2):
                w.put(f"ffn_up-{layer}", np.ones((1, 512), np.float32))
    except writer.DumpWriteError as e:
        print("DumpWriteError:", e)
        sys.exit(3)
"""


def _python_env():
    return dict(os.environ, PYTHONPATH=str(Path(writer.__file__).resolve().parents[1]))


def test_sigterm_removes_the_temporary(tmp_path):
    path = tmp_path / "t.h5"
    p = subprocess.Popen([sys.executable, "-c", _SCRIPT, str(path), "sleep"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_python_env())
    assert p.stdout.readline().strip() == "ready", p.stderr.read()
    assert [x.name for x in tmp_path.iterdir()] == [f"t.h5{writer.TEMP_INFIX}{p.pid}"]
    p.terminate()
    assert p.wait(timeout=60) == -15  # still ended by SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_one_clear_error_and_leaves_nothing(tmp_path):
    # A 200 KB tmpfs in a private mount namespace (unshare -rm), as tests/test_interrupt.cpp does.
    mnt = tmp_path / "full"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=200k tmpfs {mnt}"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a tmpfs in a private mount namespace (unshare -rm)")
    script = tmp_path / "write.py"
    script.write_text(_SCRIPT)
    r = subprocess.run(["unshare", "-rm", "sh", "-c",
                        f"mount -t tmpfs -o size=200k tmpfs {mnt} && {sys.executable} {script} {mnt}/x.h5 fill; "
                        f"echo rc=$?; ls -A {mnt}"], capture_output=True, text=True, timeout=120, env=_python_env())
    out = r.stdout.splitlines()
    assert out[0].startswith("DumpWriteError: ") and "No space left on device" in out[0], r.stdout + r.stderr
    assert "the temporary" in out[0] and "was removed" in out[0]
    assert out[1:] == ["rc=3"], r.stdout  # nothing left on the tmpfs
    assert r.stderr == "", r.stderr  # no "Exception ignored" tracebacks, no crash at exit


@pytest.mark.parametrize("name, array, kwargs, message", [
    ("embd", np.zeros((2, 4, 1), np.float32), {}, r"step_0000/embd'.*3 dimensions but layout 'T,D' names 2"),
    ("Qcur-0", np.zeros((2, 5), np.float32), {}, r"5 columns are not H\*Dh = 2\*2"),
    ("Qcur-0", np.zeros((2, 2, 2), np.float32), {"layer": 1}, "name says layer 0 but layer=1"),
    ("Qcur-3", np.zeros((2, 2, 2), np.float32), {}, "not a checkpoint of a 1-layer llama model"),
    ("Qnorm-0", np.zeros((2, 2, 2), np.float32), {}, "not a checkpoint of a 1-layer llama model"),
    ("Qcur-0", np.zeros((2, 2, 2), np.float32), {"layout": "T,H,S"}, "not a permutation"),
    ("embd", np.zeros((2, 4), np.int64), {}, "dtype int64 is not one of"),
    ("embd", np.zeros((2, 4), np.int32), {}, "token ids are int32 and checkpoints are floats"),
])
def test_bad_puts_name_the_dataset(tmp_path, name, array, kwargs, message):
    with writer.open(tmp_path / "x.h5", backend="numpy", precision="f32", meta=meta_numbers()) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        with pytest.raises(writer.DumpWriteError, match=r"x\.h5: dataset '.*" + message):
            w.put(name, array, **kwargs)


def test_twice_and_missing_meta(tmp_path):
    with writer.open(tmp_path / "x.h5", backend="numpy", precision="f32", meta=meta_numbers()) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        w.step(1)
        w.put("tokens", np.array([3], np.int32))
        w.put("embd", np.zeros((1, 4), np.float32))
        with pytest.raises(writer.DumpWriteError, match="step_0001/embd'.*recorded twice"):
            w.put("embd", np.zeros((1, 4), np.float32))
        w.put("my_engine.custom", np.zeros(3, np.float32))  # a foreign name is stored as given
    with h5py.File(tmp_path / "x.h5") as f:
        row = {r["name"]: r for r in f["step_0001/_attributes"][()]}[b"my_engine.custom"]
        assert row["layout"] == b"" and row["layer"] == -1  # layout absent
    meta = meta_numbers()
    del meta["n_ff"], meta["rope_type"]
    with pytest.raises(writer.DumpWriteError, match="missing root attributes n_ff, rope_type"):
        writer.open(tmp_path / "y.h5", backend="numpy", precision="f32", meta=meta)
    assert not (tmp_path / "y.h5").exists()


def test_reader_is_tolerant_of_absent_optional_attributes(tmp_path):
    path = tmp_path / "bare.h5"
    with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        w.put("ffn_up-0", np.ones((2, 8), np.float32))
        w.put("embd", np.ones((2, 4), np.float32))
    with h5py.File(path, "a") as f:
        del f["step_0000/_attributes"]  # no dataset has any attribute
    with diffrun.open(path) as d:
        assert d.names(0) == ["tokens", "embd", "ffn_up-0"]
        i = d.info("ffn_up-0")
        assert (i.layer, i.layout, i.native_dtype) == (0, "T,F", "f32")


def fixture_models():
    return sorted(FIXTURES.glob("*.gguf")) if FIXTURES.is_dir() else []


def test_fingerprint_matches_diffrun_inspect():
    need_cpp()
    models = fixture_models()
    smol = Path(os.environ.get("DIFFRUN_MODELS") or
                Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diffrun" / "models")
    smol = smol / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if smol.exists():
        models.append(smol)
    assert len(models) >= 10
    for model in models[::6] + [models[-1]]:
        r = subprocess.run([BIN, "inspect", str(model)], capture_output=True, text=True, check=True)
        expected = re.search(r"fingerprint (\d+:[0-9a-f]{16})", r.stdout).group(1)
        assert fingerprint(model) == expected, model.name


def test_fingerprint_is_the_dumps_model_fingerprint(reference):
    with diffrun.open(reference) as d:
        assert fingerprint(FIXTURES / "tiny-qwen3-f32.gguf") == d.meta["model_fingerprint"]


def test_fingerprint_is_a_smollm2_dumps_model_fingerprint(tmp_path):
    need_cpp()
    models = Path(os.environ.get("DIFFRUN_MODELS") or
                  Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diffrun" / "models")
    smol = models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not smol.exists():
        pytest.fail(f"{smol} is missing: run scripts/fetch_models")
    out = tmp_path / "smol.h5"
    subprocess.run([BIN, "dump", "--backend", "cpu", "--precision", "f32", "--model", str(smol), "--tokens", "1,2",
                    "--steps", "0", "--checkpoints", "result_norm", "--out", str(out)], check=True, capture_output=True)
    with diffrun.open(out) as d:
        assert fingerprint(smol) == d.meta["model_fingerprint"]


def test_data_offset_agrees_with_the_gguf_package():
    gguf = pytest.importorskip("gguf")
    for model in fixture_models()[::9]:
        assert data_offset(model) == gguf.GGUFReader(str(model)).data_offset, model.name


def test_fingerprint_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + bytes(20))
    with pytest.raises(GgufError, match="bad.gguf: not a GGUF file"):
        fingerprint(bad)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((FIXTURES / "tiny-llama-f32.gguf").read_bytes()[:200] if FIXTURES.is_dir() else b"GGUF")
    with pytest.raises(GgufError, match=r"cut.gguf: .* at offset \d+ runs past the end of the file"):
        fingerprint(cut)


def test_reader_takes_2d_per_head_and_permuted_layouts(tmp_path):
    path = tmp_path / "perm.h5"
    q = np.arange(2 * 2 * 2, dtype=np.float32).reshape(2, 2, 2)  # [T, H, Dh]
    with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        w.put("Qcur-0", q)
        w.put("Krope-0", np.zeros((2, 1, 2), np.float32))
        w.put("kq_soft_max-0", np.arange(8, dtype=np.float32).reshape(2, 2, 2))  # [H, T, S]
    with h5py.File(path, "a") as f:
        g = f["step_0000"]
        del g["Qcur-0"]
        g.create_dataset("Qcur-0", data=q.transpose(1, 0, 2))  # stored H,T,Dh
        rows = dump_h5.table(g)
        rows["Qcur-0"]["layout"] = "H,T,Dh"
        data = np.zeros((2, 2), np.float32)
        del g["Krope-0"]
        g.create_dataset("Krope-0", data=data)  # [T, Hkv*Dh], no attributes
        del rows["Krope-0"]
        sm = g["kq_soft_max-0"][()]
        del g["kq_soft_max-0"]
        g.create_dataset("kq_soft_max-0", data=sm.transpose(1, 0, 2))
        rows["kq_soft_max-0"]["layout"] = "T,H,S"
        dump_h5.write_table(g, rows)
    with diffrun.open(path) as d:
        np.testing.assert_array_equal(d.get("Qcur-0"), q)
        assert d.info("Qcur-0").layout == "T,H,Dh" and d.info("Qcur-0").stored_layout == "H,T,Dh"
        assert d.get("Krope-0").shape == (2, 1, 2) and d.info("Krope-0").shape == (2, 1, 2)
        np.testing.assert_array_equal(d.get("kq_soft_max-0"), np.arange(8, dtype=np.float32).reshape(2, 2, 2))


def test_native_dtypes_and_layouts_compare_clean_in_cpp(reference, tmp_path):
    """float64, float16/bf16 bits of exactly representable values, [T, H*Dh] and permuted layouts, as diffrun reads them."""
    out = tmp_path / "mixed.h5"
    with diffrun.open(reference) as ref, writer.open(out, backend="python", precision="f32", like=ref,
                                                      keep_dtype=True) as w:
        for step in ref.steps():
            w.step(step)
            for i, name in enumerate(ref.names(step)):
                a = ref.get(name, step)
                if name == "tokens":
                    w.put(name, a)
                elif name.startswith("Kcur"):
                    w.put(name, a.transpose(1, 0, 2).copy(), layout="Hkv,T,Dh")
                elif a.ndim == 3 and name[0] in "QV":
                    w.put(name, a.reshape(a.shape[0], -1))
                else:
                    w.put(name, a.astype(np.float64))
    rc, report = compare(out, reference, tmp_path)
    assert rc == 0, report["first_divergence"]
    assert all(c["metrics"]["max_abs"] == 0 for c in report["checkpoints"] if c.get("metrics")), \
        "every value must come back exactly"
    exact = np.array([1.0, -2.5, 0.15625, 3.0], np.float32)  # exact in f16 and bf16
    for dtype, data in (("f16", exact.astype(np.float16)), ("bf16", writer.f32_to_bf16(exact))):
        path = tmp_path / f"{dtype}.h5"
        with writer.open(path, backend="python", precision="f32", meta=meta_numbers(), keep_dtype=True) as w:
            w.put("tokens", np.array([1, 2], np.int32))
            w.put("embd", np.tile(data, (2, 1)))
        r = subprocess.run([BIN, "show", str(path), "embd"], capture_output=True, text=True)
        assert r.returncode == 0 and "-2.5" in r.stdout and "0.15625" in r.stdout, r.stdout + r.stderr


# --- the C API's contract (capi/dump_writer.cpp): refused at the call that breaks it, never renamed into place ------

def assert_nothing_invalid_left(tmp_path, path):
    """No temporary is left; a dump at `path`, if any, is valid."""
    assert not list(tmp_path.glob(f"*{writer.TEMP_INFIX}*"))
    if path.exists():
        from diffrun.validate import validate
        assert validate(path).valid, validate(path).problems


def test_n_layer_is_bounded_in_the_writer_and_the_validator(tmp_path):
    from diffrun.validate import MAX_LAYERS, validate
    meta = dict(meta_numbers(), n_layer=2_000_000_000)
    with pytest.raises(writer.DumpWriteError, match=rf"'n_layer' is 2000000000, outside 1\.\.{MAX_LAYERS}"):
        writer.open(tmp_path / "x.h5", backend="numpy", precision="f32", meta=meta)
    assert list(tmp_path.iterdir()) == []
    # A dump that claims it: the writer opened like= it refuses it, the validator lists it (no MemoryError).
    claims = tmp_path / "claims.h5"
    with writer.open(claims, backend="numpy", precision="f32", meta=meta_numbers()) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        w.put("embd", np.zeros((2, 4), np.float32))
    with h5py.File(claims, "a") as f:
        f.attrs.modify("n_layer", np.int32(2_000_000_000))
    with pytest.raises(writer.DumpWriteError, match=r"'n_layer' is 2000000000, outside 1\.\."):
        writer.open(tmp_path / "y.h5", backend="numpy", precision="f32", like=claims)
    assert not (tmp_path / "y.h5").exists()
    problems = [(p.where, p.what) for p in validate(claims).problems]
    assert ("root attribute 'n_layer'", f"is 2000000000, outside 1..{MAX_LAYERS} (no model has more layers; "
            "readers refuse it)") in problems
    # the bound itself is allowed
    with writer.open(tmp_path / "z.h5", backend="numpy", precision="f32", meta=dict(meta_numbers(), n_layer=MAX_LAYERS)) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        w.put(f"l_out-{MAX_LAYERS - 1}", np.zeros((2, 4), np.float32))
    assert validate(tmp_path / "z.h5").valid


@pytest.mark.parametrize("meta_change, message", [
    ({"token_ids": [1, 99999]}, r"token_ids': holds id 99999, outside the vocabulary 0\.\.9"),
    ({"n_head_kv": 3}, "does not divide n_head"),
    ({"rope_type": "yarn"}, "root attribute 'rope_type'"),
    ({"n_embd": 0}, "n_embd': is 0, expected a positive integer"),
])
def test_root_attributes_are_checked_when_the_writer_opens(tmp_path, meta_change, message):
    with pytest.raises(writer.DumpWriteError, match="the root attributes are not complete.*" + message):
        writer.open(tmp_path / "x.h5", backend="numpy", precision="f32", meta=dict(meta_numbers(), **meta_change))
    assert list(tmp_path.iterdir()) == []


def test_steps_are_0_1_2_in_order(tmp_path):
    path = tmp_path / "x.h5"
    with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
        with pytest.raises(writer.DumpWriteError, match="step 1 out of order: steps are 0, 1, 2, ... and the next is 0"):
            w.step(1)  # no step 0
        w.step(0)
        w.put("tokens", np.array([1, 2], np.int32))
        with pytest.raises(writer.DumpWriteError, match="step 2 out of order: .* the next is 1"):
            w.step(2)  # a gap
        with pytest.raises(writer.DumpWriteError, match="step 0 out of order"):
            w.step(0)  # again
        with pytest.raises(writer.DumpWriteError, match="step -1 is negative"):
            w.step(-1)
        w.step(1)
        w.put("tokens", np.array([3], np.int32))
    with diffrun.open(path) as d:
        assert d.steps() == [0, 1] and list(d.meta["all_token_ids"]) == [1, 2, 3]
    assert_nothing_invalid_left(tmp_path, path)


def test_every_step_records_its_tokens_first(tmp_path):
    path = tmp_path / "x.h5"
    with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
        with pytest.raises(writer.DumpWriteError, match=r"step_0000/embd'.*put \"tokens\" first in every step"):
            w.put("embd", np.zeros((2, 4), np.float32))
        with pytest.raises(writer.DumpWriteError, match=r"step_0000/foreign'.*put \"tokens\" first"):
            w.put("foreign", np.zeros(3, np.float32))
        with pytest.raises(writer.DumpWriteError, match="step 0 recorded no tokens"):
            w.step(1)
        w.put("tokens", np.array([1, 2], np.int32))
        w.put("embd", np.zeros((2, 4), np.float32))
        w.step(1)
        with pytest.raises(writer.DumpWriteError, match=r"step_0001/embd'.*put \"tokens\" first"):
            w.put("embd", np.zeros((1, 4), np.float32))
    with diffrun.open(path) as d:  # step 1 recorded nothing: the dump ends at step 0
        assert d.steps() == [0] and d.names(0) == ["tokens", "embd"]
    assert_nothing_invalid_left(tmp_path, path)


@pytest.mark.parametrize("step, ids, message", [
    (0, np.array([1, 99999], np.int32), r"id 99999 outside the vocabulary 0\.\.9"),
    (0, np.array([1, 2 ** 40]), r"id 1099511627776 outside the vocabulary 0\.\.9"),  # int64, not wrapped to int32
    (0, np.array([1, -1], np.int32), r"id -1 outside the vocabulary"),
    (0, np.array([2, 1], np.int32), "step 0's tokens differ from the root attribute token_ids"),
    (0, np.zeros(0, np.int32), r"shape \[0\], expected \[T\] with T >= 1"),
    (0, np.array([[1, 2]], np.int32), r"shape \(1, 2\) has 2 dimensions but layout 'T' names 1"),
    (1, np.array([3, 4], np.int32), "2 ids; a decode step feeds one"),
    (1, np.array([99999], np.int32), r"id 99999 outside the vocabulary 0\.\.9"),
])
def test_token_ids_are_checked(tmp_path, step, ids, message):
    path = tmp_path / "x.h5"
    w = writer.open(path, backend="numpy", precision="f32", meta=meta_numbers())
    if step == 1:
        w.put("tokens", np.array([1, 2], np.int32))
        w.step(1)
    with pytest.raises(writer.DumpWriteError, match=rf"step_000{step}/tokens'.*{message}"):
        w.put("tokens", ids)
    assert w.names(step) == []
    if step == 0:  # nothing recorded: close() refuses to rename it into place
        with pytest.raises(writer.DumpWriteError, match="no step recorded"):
            w.close()
        assert list(tmp_path.iterdir()) == []
    else:
        w.close()
        assert diffrun.open(path).steps() == [0]
    assert_nothing_invalid_left(tmp_path, path)


def test_teacher_forcing_follows_all_token_ids(tmp_path):
    with writer.open(tmp_path / "x.h5", backend="numpy", precision="f32",
                     meta=dict(meta_numbers(), all_token_ids=[1, 2, 7])) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        w.step(1)
        with pytest.raises(writer.DumpWriteError, match="id 8 but all_token_ids feeds 7 at this step"):
            w.put("tokens", np.array([8], np.int32))
        w.put("tokens", np.array([7], np.int32))


@pytest.mark.parametrize("name, shape, message", [
    ("Qcur-0", (2, 3, 2), r"shape \[2, 3, 2\] does not fit layout 'T,H,Dh' = \[2, 2, 2\]"),  # 3 heads, n_head = 2
    ("Kcur-0", (2, 2, 2), r"shape \[2, 2, 2\] does not fit layout 'T,Hkv,Dh' = \[2, 1, 2\]"),  # n_head_kv = 1
    ("kq_soft_max-0", (3, 2, 2), r"does not fit layout 'H,T,S' = \[2, 2, 2\]"),
    ("embd", (3, 4), r"shape \[3, 4\] does not fit layout 'T,D' = \[2, 4\] \(T = 2, S = 2\)"),  # T is the tokens'
    ("ffn_up-0", (2, 9), r"does not fit layout 'T,F' = \[2, 8\]"),
    ("result_output", (2, 11), r"does not fit layout 'T,V' = \[2, 10\]"),
])
def test_checkpoint_shapes_fit_the_config(tmp_path, name, shape, message):
    path = tmp_path / "x.h5"
    with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        with pytest.raises(writer.DumpWriteError, match=rf"step_0000/{name}'.*{message}"):
            w.put(name, np.zeros(shape, np.float32))
        assert w.names(0) == ["tokens"]
    assert_nothing_invalid_left(tmp_path, path)


def test_the_cache_grows_by_each_steps_tokens(tmp_path):
    path = tmp_path / "x.h5"
    with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        w.put("cache_k-0", np.zeros((2, 1, 2), np.float32))  # [S, Hkv, Dh]
        w.step(1)
        w.put("tokens", np.array([3], np.int32))
        with pytest.raises(writer.DumpWriteError, match=r"S = 3"):
            w.put("cache_k-0", np.zeros((2, 1, 2), np.float32))
        w.put("cache_k-0", np.zeros((3, 1, 2), np.float32))
        w.put("kq_soft_max-0", np.zeros((2, 1, 3), np.float32))  # [H, T, S]
    assert_nothing_invalid_left(tmp_path, path)


@pytest.mark.parametrize("name", ["..", ".", "a/b/c", "/abs", "", "nul\0byte"])
def test_dataset_names_that_hdf5_would_resolve_are_refused(tmp_path, name):
    path = tmp_path / "x.h5"
    with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
        w.put("tokens", np.array([1, 2], np.int32))
        with pytest.raises(writer.DumpWriteError, match="is not a valid dataset name"):
            w.put(name, np.zeros(3, np.float32))
    with h5py.File(path) as f:
        assert sorted(f.keys()) == ["step_0000"] and sorted(f["step_0000"].keys()) == ["_attributes", "tokens"]
    assert_nothing_invalid_left(tmp_path, path)


def test_close_refuses_a_dump_without_step_0(tmp_path):
    path = tmp_path / "x.h5"
    w = writer.open(path, backend="numpy", precision="f32", meta=meta_numbers())
    with pytest.raises(writer.DumpWriteError, match=r"no step recorded \(a dump holds at least step 0 with its "
                                                    r"tokens\); not renamed into place, the temporary .* was removed"):
        w.close()
    assert list(tmp_path.iterdir()) == []
    w.close()  # closed: a no-op
    # the with block: the same refusal, nothing left
    with pytest.raises(writer.DumpWriteError, match="no step recorded"):
        with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
            w.step(0)
    assert list(tmp_path.iterdir()) == []


def test_close_refuses_root_attributes_set_against_the_steps(tmp_path):
    path = tmp_path / "x.h5"
    with pytest.raises(writer.DumpWriteError, match=r"'argmax': holds 3 ids for 2 steps .*not renamed into place"):
        with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
            w.put("tokens", np.array([1, 2], np.int32))
            w.step(1)
            w.put("tokens", np.array([3], np.int32))
            w.set_attribute("argmax", [3, 4, 5])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(writer.DumpWriteError, match=r"all_token_ids': holds id 12, outside the vocabulary"):
        with writer.open(path, backend="numpy", precision="f32", meta=meta_numbers()) as w:
            w.put("tokens", np.array([1, 2], np.int32))
            w.set_attribute("all_token_ids", [1, 2, 12])
    assert list(tmp_path.iterdir()) == []
