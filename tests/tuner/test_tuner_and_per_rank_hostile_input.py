"""Issue 25 (no silent wrong answer, round two): the tuner's and the per-rank doors, as a hostile
or careless user tries them. Each test failed on the main branch before its fix."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from memsave_nb.checkpointing import PlanError
from memsave_nb.errors import MemsaveError
from memsave_nb.measure import measure
from memsave_nb.model_state import ModelSnapshot
from memsave_nb.plan import Plan
from memsave_nb.session import Session
from memsave_nb.target import Target, max_batch, measure_peak
from memsave_nb.workload import Workload


def _mlp(batch: int = 4) -> Workload:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return Workload(model, torch.randn(batch, 16), name="mlp")


def _one_line(exc: BaseException, limit: int = 300) -> str:
    text = str(exc)
    assert "\n" not in text and len(text) < limit, text[:400]
    return text


# -- 1. fake-mode tuning must not allocate the resized batch ----------------------------------


def _rss_probe(code: str, cap_gb: float | None = None) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (optionally under an address-space cap)."""
    prelude = ""
    if cap_gb is not None:
        prelude = (
            f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({int(cap_gb * 2**30)}, {int(cap_gb * 2**30)}))\n"
        )
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=240
    )


def test_fake_mode_big_batch_adds_no_rss():
    """Batch 4096 of a 3x64x64 input in fake mode: the resized batch (192 MiB as real floats) is
    fake, so the process's peak RSS grows by far less than the batch would take."""
    code = """
        import resource, torch
        from torch import nn
        from memsave_nb.plan import Plan
        from memsave_nb.target import measure_peak
        from memsave_nb.workload import Workload
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.LazyLinear(2))
        model(torch.zeros(1, 3, 64, 64))
        wl = Workload(model, torch.randn(4, 3, 64, 64))
        measure_peak(wl, Plan(batch_size=8))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        m = measure_peak(wl, Plan(batch_size=4096))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert m.peak_bytes > 4096 * 3 * 64 * 64 * 4, m.peak_bytes
        print((after - before) // 1024)
    """
    out = _rss_probe(code)
    assert out.returncode == 0, out.stderr[-2000:]
    grown_mib = int(out.stdout.split()[-1])
    assert grown_mib < 96, f"fake-mode batch 4096 grew RSS by {grown_mib} MiB"


def test_max_batch_of_a_big_input_under_an_address_space_cap():
    """max_batch in fake mode on 224x224 images under a 3 GiB address-space cap: probes at batch
    8192 and beyond (4.9 GB as real floats) run on fake tensors."""
    code = """
        import torch
        from torch import nn
        from memsave_nb.plan import Plan
        from memsave_nb.target import Target, max_batch
        from memsave_nb.workload import Workload
        model = nn.Sequential(nn.Conv2d(3, 2, 8, stride=8), nn.Flatten(), nn.Linear(2 * 28 * 28, 2))
        def workload():
            y = torch.zeros(4, dtype=torch.long)  # closed over: the loss's targets follow the batch
            return Workload(model, torch.randn(4, 3, 224, 224), loss=lambda out: nn.functional.cross_entropy(out, y))
        wl = workload()
        r = max_batch(wl, Plan(), Target(80), upper=1 << 15)
        print(r.value, r.count)
    """
    out = _rss_probe(code, cap_gb=3)
    assert out.returncode == 0, out.stderr[-2000:]
    value = int(out.stdout.split()[-2])
    assert value == 1 << 15  # 80 GiB holds 32768 such images and more


def test_real_mode_batch_that_cannot_fit_says_so_before_allocating():
    wl = _mlp()
    snap = ModelSnapshot.capture(wl.model)
    with pytest.raises(MemsaveError) as info:
        with Plan(batch_size=2**31 - 1).apply(wl) as w:
            measure(w, repeats=0)
    text = _one_line(info.value)
    assert "memory" in text
    assert snap.differences(wl.model) == []


# -- 2. bf16 on a model that holds gradients ----------------------------------------------------


def _trained(wl: Workload) -> dict[str, torch.Tensor]:
    wl.model(wl.batch).sum().backward()
    return {n: p.grad for n, p in wl.model.named_parameters()}


@pytest.mark.parametrize("precision", ["bf16", "bf16_master"])
def test_bf16_on_a_model_with_grads_measure_and_measure_peak(precision):
    wl = _mlp()
    grads = _trained(wl)
    copies = {n: g.clone() for n, g in grads.items()}
    with Plan(precision=precision).apply(wl) as w:
        m = measure(w, repeats=0)
    assert m.peak_bytes > 0
    assert measure_peak(wl, Plan(precision=precision)).peak_bytes > 0
    for n, p in wl.model.named_parameters():
        assert p.grad is grads[n] and p.dtype == torch.float32
        assert torch.equal(p.grad, copies[n])


def test_bf16_on_a_model_with_grads_session_and_planner():
    from memsave_nb.planner.search import plan_for

    wl = _mlp()
    grads = _trained(wl)
    entry = Session(wl, mode="fake").run(Plan(precision="bf16"))
    assert entry.measurement.peak_bytes > 0
    result = plan_for(wl, Target(1), precisions=("bf16", "bf16_master"), region_kinds=(), regions=[], remeasure=1)
    assert not [n for n in result.notes if "skipped" in n], result.notes
    assert all(p.grad is grads[n] for n, p in wl.model.named_parameters())


# -- 2. Adafactor per rank --------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_adafactor_per_rank(strategy):
    from memsave_nb.parallel import ParallelSpec, measure_parallel

    wl = _mlp()
    snap = ModelSnapshot.capture(wl.model)
    spec = ParallelSpec(world_size=3, strategy=strategy)
    if strategy == "ddp":  # DDP's parameters are plain tensors: Adafactor steps them as on one device
        r = measure_parallel(wl, spec, Plan(optimizer="adafactor"))
        assert r.peak_bytes > 0
        sgd = measure_parallel(wl, spec, Plan(optimizer="sgd"))
        assert r.ranks[0].end_split["optimizer_state"] > sgd.ranks[0].end_split.get("optimizer_state", 0)
    else:  # torch's Adafactor cannot step DTensors (in real mode neither): said in one line
        with pytest.raises(MemsaveError) as info:
            measure_parallel(wl, spec, Plan(optimizer="adafactor"))
        assert "adafactor" in _one_line(info.value)
    assert snap.differences(wl.model) == []


# -- 3. hostile numbers and arguments ---------------------------------------------------------


@pytest.mark.parametrize("gb", [float("inf"), float("nan"), 1e300, 1e308, 10**400, -1.0])
def test_target_refuses_infinite_and_absurd_sizes(gb):
    with pytest.raises(PlanError) as info:
        Target(gb)
    _one_line(info.value)


@pytest.mark.parametrize("n", [10**30, 2**40, 2**31])
def test_plan_refuses_absurd_batch_sizes(n):
    for field in ("batch_size", "seq_len", "accumulation_steps"):
        with pytest.raises(PlanError) as info:
            Plan(**{field: n})
        _one_line(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"precision": "p" * 200_000},
        {"optimizer": "o" * 200_000},
        {"batch_size": "9" * 200_000},
        {"set_to_none": "x" * 200_000},
        {"parallel": {"world_size": "w" * 200_000}},
        {"parallel": {"strategy": "s" * 200_000}},
        {"parallel": {"param_dtype": "d" * 200_000}},
        {"parallel": {"x" * 200_000: 1}},
        {"parallel": "q" * 200_000},
    ],
)
def test_bad_knob_and_parallel_values_are_cut_like_the_older_fields(kwargs):
    with pytest.raises(PlanError) as info:
        Plan(**kwargs)
    assert len(_one_line(info.value)) < 200


def test_shard_modules_must_be_names_not_a_dict():
    from memsave_nb.parallel import ParallelSpec
    from memsave_nb.parallel_spec import ParallelError

    with pytest.raises(ParallelError):
        ParallelSpec(shard_modules={"a": 1})


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"micro_batches": [0]}, "micro_batches"),
        ({"micro_batches": [-2]}, "micro_batches"),
        ({"micro_batches": [1.5]}, "micro_batches"),
        ({"micro_batches": 2}, "micro_batches"),
        ({"regions": ["nope"]}, "nope"),
        ({"regions": "0"}, "regions"),
        ({"base_plan": "x"}, "base_plan"),
        ({"freezing": {"a": None}}, "freezing"),
        ({"freezing": {"a": "p"}}, "freezing"),
        ({"mode": "bogus"}, "mode"),
        ({"remeasure": -1}, "remeasure"),
        ({"precisions": ("p",)}, "precision"),
        ({"memsave": (1,)}, "memsave"),
        ({"compile_budgets": (2.0,)}, "budget"),
        ({"link": ["pcie5"]}, "link"),
        ({"region_kinds": ("x",)}, "region kind"),
    ],
)
def test_plan_for_names_a_bad_argument_before_any_work(kwargs, word):
    from memsave_nb.planner.search import plan_for

    wl = _mlp()
    snap = ModelSnapshot.capture(wl.model)
    with pytest.raises(PlanError) as info:
        plan_for(wl, Target(1), **kwargs)
    assert word in _one_line(info.value)
    assert snap.differences(wl.model) == []


def test_plan_for_refuses_a_target_that_is_not_one():
    from memsave_nb.planner.search import plan_for

    for target in (24, None, "80"):
        with pytest.raises(PlanError):
            plan_for(_mlp(), target)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"mode": "bogus"}, "mode"),
        ({"upper": 0}, "upper"),
        ({"upper": 10**30}, "upper"),
    ],
)
def test_max_batch_names_a_bad_argument(kwargs, word):
    wl = _mlp()
    with pytest.raises(MemsaveError) as info:
        max_batch(wl, Plan(), Target(1), **kwargs)
    assert word in _one_line(info.value)
    with pytest.raises(MemsaveError):
        max_batch(wl, None, Target(1))  # type: ignore[arg-type]
    for target in (24, None):
        with pytest.raises(MemsaveError):
            max_batch(wl, Plan(), target)  # type: ignore[arg-type]


# -- 3. offload ledger, session history -------------------------------------------------------


class _Boom(nn.Module):
    def forward(self, x):
        raise RuntimeError("boom")


def test_offload_ledger_forgets_a_failed_step():
    from memsave_nb.offload import LEDGER

    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)), _Boom())
    wl = Workload(model, torch.randn(8, 16))
    LEDGER.reset()
    for mode in ("real", "fake"):
        with pytest.raises(MemsaveError):
            with Plan(regions={"0": "offload"}).apply(wl) as w:
                measure(w, mode=mode, repeats=0)
        gc.collect()
        assert LEDGER.live_bytes == 0, mode


def test_session_clear_gives_the_history_back():
    """The history's measurements die with clear(): nothing keeps them alive."""
    import weakref

    session = Session(_mlp(), mode="fake")
    entries = [session.run(Plan(batch_size=b)) for b in (2, 3)]
    refs = [weakref.ref(e.measurement) for e in entries]
    del entries
    session.clear()
    gc.collect()
    assert [r() for r in refs] == [None, None]
    assert session.history == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and glibc's malloc_trim")
def test_session_clear_returns_resident_memory():
    """300 runs of history, then clear(): the process's resident memory drops (on main it did not
    move: the freed history stayed in the allocator's pages)."""
    code = """
        import gc
        from memsave_nb import zoo
        from memsave_nb.plan import Plan
        from memsave_nb.session import Session
        def rss():
            return int(open("/proc/self/statm").read().split()[1]) * 4096
        s = Session(zoo.make("mlp"), mode="fake", repeats=0)
        for _ in range(20):
            s.run(Plan())
        s.clear()
        start = rss()
        for _ in range(300):
            s.run(Plan())
        full = rss()
        s.clear()
        print(start, full, rss())
    """
    out = _rss_probe(code)
    assert out.returncode == 0, out.stderr[-2000:]
    start, full, cleared = map(int, out.stdout.split()[-3:])
    assert full - start > 2**20, "the history should take memory to give back"
    assert full - cleared >= 0.2 * (full - start), (start, full, cleared)
