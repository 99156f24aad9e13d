"""`import sppo_fx` loads what `compile` needs and no more: the Triton kernels (and
torch._inductor, which `triton_op` pulls in), the activation store's tiers and the
benchmark engine load when first used. Checked in a fresh interpreter, since this test
process has imported everything already."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["triton", "sppo_fx.chunk_attention.op", "sppo_fx.chunk_attention.kernels.triton_kernels",
         "sppo_fx.chunk_attention.kernels.triton_launch", "sppo_fx.runtime.store.disk",
         "sppo_fx.runtime.store.activation_store", "sppo_fx.benchmark.engine", "sppo_fx.benchmark.plot",
         "matplotlib", "torch._inductor"]


def _modules_after(code: str) -> set[str]:
    probe = code + "\nimport sys, json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_sppo_fx_loads_no_triton_store_or_benchmark():
    loaded = _modules_after("import sppo_fx\nassert callable(sppo_fx.compile)")
    assert "sppo_fx.api" in loaded  # compile itself is there, not deferred
    assert not [m for m in HEAVY if m in loaded], [m for m in HEAVY if m in loaded]


def test_lazy_names_load_their_modules_when_used():
    loaded = _modules_after("from sppo_fx.runtime.store import ActivationStore, TIERS\n"
                            "from sppo_fx.ops import chunk_attention_with_lse, chunk_attention\n"
                            "import types; assert not isinstance(chunk_attention, types.ModuleType)\n"
                            "import sppo_fx.ops.skeleton as s, torch\n"
                            "q = torch.zeros(1, 2, 3, 4)\n"
                            "assert s.bshd_empty_like(q).shape == q.shape\n"
                            "assert 'disk' in TIERS and callable(chunk_attention_with_lse)")
    assert {"sppo_fx.runtime.store.activation_store", "sppo_fx.chunk_attention.op"} <= loaded
