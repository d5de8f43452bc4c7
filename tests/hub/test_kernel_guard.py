"""Importing memsave_nb and then peft / bitsandbytes never asks the hub for a kernel.

bitsandbytes 0.50 calls ``kernels.get_kernel`` while its CPU backend is imported on AVX512-BF16 CPUs;
:mod:`memsave_nb.kernel_guard` refuses that one call. Each case runs in a fresh interpreter, since
an import happens once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env_extra: dict[str, str] | None = None, tmp: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tmp or ""), str(ROOT)) if p)}
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=240
    )


def _fake_backend(tmp: Path) -> None:
    """A module that asks ``kernels`` for a hub kernel at import, as bitsandbytes' CPU backend does."""
    pkg = tmp / "fakebnb"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ops.py").write_text(
        "try:\n"
        "    from kernels import get_kernel\n"
        "    KERNEL = get_kernel('kernels-community/some-kernel', version=1)\n"
        "except Exception as exc:\n"
        "    KERNEL = 'refused: ' + str(exc)\n"
    )


PROBE = """
import json, memsave_nb, memsave_nb.kernel_guard as guard
guard.GUARDED_MODULE = "fakebnb.ops"
import fakebnb.ops
import kernels
print(json.dumps({"kernel": str(fakebnb.ops.KERNEL), "refused": guard.refused,
                  "get_kernel_restored": kernels.get_kernel.__module__ != "memsave_nb.kernel_guard"}))
"""


def test_a_module_that_fetches_a_hub_kernel_at_import_is_refused_once_and_kernels_is_left_as_it_was(tmp_path):
    pytest.importorskip("kernels")
    _fake_backend(tmp_path)
    out = _run(PROBE, tmp=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["refused"] == ["kernels-community/some-kernel"]
    assert got["kernel"].startswith("refused: memsave_nb does not fetch hub kernels (kernels-community/some-kernel)")
    assert got["get_kernel_restored"]  # only that import saw the refusal


def test_the_environment_switch_turns_the_guard_off(tmp_path):
    pytest.importorskip("kernels")
    _fake_backend(tmp_path)
    out = _run(PROBE, {"MEMSAVE_NB_HUB_KERNELS": "1", "HF_HUB_OFFLINE": "1"}, tmp=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["refused"] == []
    assert not got["kernel"].startswith("refused: memsave_nb")  # kernels' own answer (offline here)


def _cpu_has_avx512_bf16() -> bool:
    try:
        return "avx512_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not _cpu_has_avx512_bf16(), reason="bitsandbytes asks the hub only on AVX512-BF16 CPUs")
def test_the_real_bitsandbytes_import_asks_nothing_of_the_hub_and_prints_nothing():
    pytest.importorskip("bitsandbytes")
    out = _run(
        """
        import json, memsave_nb, memsave_nb.kernel_guard as guard
        import peft, bitsandbytes
        print(json.dumps(guard.refused))
        """,
        {"HF_HUB_OFFLINE": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["kernels-community/quantization-bitsandbytes"]
    assert "Failed to load CPU gemm_4bit_forward" not in out.stderr
