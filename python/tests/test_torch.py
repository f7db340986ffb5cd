"""diffrun.torch: forward hooks on any nn.Module record into a dump, by module name or mapped names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import diffrun
import diffrun.torch as dtorch
from diffrun import writer


def meta():
    return dict(model_path="m", model_fingerprint="1:0", arch="llama", n_layer=1, n_embd=4, n_head=2,
                n_head_kv=1, head_dim=2, n_ff=8, n_vocab=10, n_ctx=16, rope_theta=1e4, rope_type="norm",
                rms_eps=1e-5, tied_output=False, qkv_bias=False, qk_norm=False, prompt="", token_ids=[1, 2])


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(4, 8)
        self.down = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))) + self.down(self.up(x))  # down is called twice


def test_records_by_module_name_with_repeats(tmp_path):
    m = Tiny()
    x = torch.randn(1, 3, 4)
    with writer.open(tmp_path / "t.h5", backend="torch", precision="f32", meta=meta()) as w:
        with dtorch.record(m, w, ["up", "down"]):
            w.step(0)
            w.put("tokens", np.array([1, 2], np.int32))  # every step records its tokens first
            m(x)
        m(x)  # after the with block nothing is recorded
    with diffrun.open(tmp_path / "t.h5") as d:
        assert d.names(0) == ["tokens", "up", "down", "up#2", "down#2"]  # forward calls each twice
        np.testing.assert_allclose(d.get("up"), m.up(x)[0].detach().numpy(), rtol=1e-6)
        np.testing.assert_allclose(d.get("down#2"), m.down(m.up(x))[0].detach().numpy(), rtol=1e-6)


def test_mapped_names_pre_hooks_and_bf16(tmp_path):
    m = Tiny().to(torch.bfloat16)
    x = torch.randn(1, 3, 4, dtype=torch.bfloat16)
    with writer.open(tmp_path / "t.h5", backend="torch", precision="bf16", meta=meta()) as w:
        with dtorch.record(m, w, ["up"], names={"up": "ffn_up-0"}):
            with dtorch.record(m, w, ["down"], names=lambda n: "ffn_swiglu-0" if n == "down" else None, pre=True):
                w.step(0)
                w.put("tokens", np.array([1, 2], np.int32))
                m(x[:, :2])
    with diffrun.open(tmp_path / "t.h5") as d:
        assert d.names(0) == ["tokens", "ffn_up-0", "ffn_swiglu-0", "ffn_up-0#2", "ffn_swiglu-0#2"]
        assert d.info("ffn_up-0").native_dtype == "bf16"
        np.testing.assert_array_equal(d.get("ffn_up-0"), m.up(x[:, :2])[0].detach().float().numpy())


def test_unknown_module_is_an_error(tmp_path):
    with writer.open(tmp_path / "t.h5", backend="torch", precision="f32", meta=meta()) as w:
        with pytest.raises(KeyError, match="no submodule named nope"):
            dtorch.record(Tiny(), w, ["nope"])
        w.put("tokens", np.array([1, 2], np.int32))  # a dump holds at least step 0 with its tokens
