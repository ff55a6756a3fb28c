"""``agentrl bench trainer``: agentrl's GRPO against TRL's ``GRPOTrainer``, side by side.

Both start from the same checkpoint (the tiny model after a short, deliberately imperfect SFT
warm start on a one-answer task: "Say seven." answered "7" half of the time), train on the same
prompts with the same batch (``--prompts`` prompts × ``--n`` samples, one optimizer step per
step), learning rate, clip range, response length and number of steps, and are evaluated by one
evaluator: the built-in engine sampling at temperature 1 on held-out prompts with fixed seeds,
scored by the same reward function (``gsm8k_flexible``: the last number must be 7).

Matched settings: no KL (TRL's ``beta=0``), GRPO group normalization with the std
(``scale_rewards="group"``), token-mean loss over the whole batch (TRL's ``dapo``), constant
learning rate, gradient clipping at 1.0, fp32, no reference model, and the same work: TRL keeps
no rollouts, so agentrl's side does not write its rollout store (``trainer.save_rollouts=false``;
its cost: docs/benchmarks.md). agentrl runs its real
training path: ``agentrl train``'s, with one actor rank, so its groups run in the process
(``trainer.workers=auto``: no Ray) and the rank trains the module unwrapped (``dist.shard_model``),
the built-in engine colocated with the actor, the single-turn agent loop (``--task calculator``:
the tool loop, ``trainer_calculator.py``); TRL runs in its process with transformers'
``generate`` (``--trl-generation continuous``: its continuous batching).

Each side trains ``--repeats`` times (default 3), each time in a process of its own, the sides
alternating which goes first (agentrl, TRL, TRL, agentrl, agentrl, TRL, ...) so that the
machine's drift hits both alike; every run's policy is evaluated. Two times per run:

* step time: the mean wall time of the steps after the first (which pays one-time costs), each
  step being generation + scoring + update (+ agentrl's weight sync);
* end to end (``e2e_s``): from before the side's process starts to its exit: interpreter
  start-up, imports, model load, the training, saving the policy and shutting down. ``outside_train_s`` is the part of it outside the training call.

Prints one JSON object. Per side (``agentrl_*``, ``trl_*``), the median over the repeats of:
``step_s``, ``e2e_s``, ``reward`` (held-out evaluation; each also with ``_min``, ``_max`` and
``_all``, the repeats in running order), ``first_step_s``, ``tokens_per_s``,
``train_reward_last``, ``train_wall_s`` (the training call), ``outside_train_s``; and
``*_train_rewards`` (the first repeat's, per step); ``agentrl_startup_s``: agentrl's start-up
phases (``startup/*`` of its summary), each the median over the repeats. Besides: ``ratio`` (TRL's median step time
over agentrl's), ``e2e_ratio`` (the same end to end), ``order``, ``repeats``, ``start_reward``,
``eval_answers`` (with ``start_reward_se`` and ``*_reward_se``: a held-out figure's own binomial
standard error over that many 0/1 answers), ``trl_version`` and the settings.

agentrl's side starts as ``agentrl train`` does: on a machine already busy (other work keeping half
a core or more busy as it starts) with ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets a policy
(``agentrl.cli.shared_machine_wait_policy``), and with Python's garbage collector paused until its
models are loaded (``agentrl.trainer.startup.pause_collector``); TRL's side keeps libgomp's default
and the collector as a TRL user gets them (``*_omp_wait_policy_all``: each run's policy). ``--beside-cpu-job``: a Python busy loop shares
the cores for the whole benchmark.

    agentrl bench trainer --json [--task seven|calculator] [--steps 10] [--prompts 8] [--n 8] [--repeats 3] [--rl-seed S] [--skip-trl | --skip-agentrl] [--beside-cpu-job]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentrl_benchmarks import trainer_calculator as calculator
from agentrl_benchmarks._scratch import private_ray_temp_dir, scratch_dir
from agentrl_benchmarks._sft import supervised

__all__ = ["main", "Settings", "trl_config"]

GROUND_TRUTH = "7"
DATA_SOURCE = "bench/seven"


@dataclass(frozen=True)
class Settings:
    task: str = "seven"  # seven: one answer, one turn; calculator: arithmetic through the calculator tool, several turns
    model_size: str = "1m"
    answer: str = "short"  # short: "7"; counting: a ~36-token sentence ending in the number
    steps: int = 10
    prompts: int = 8  # prompts per step
    n: int = 8  # samples per prompt
    max_new_tokens: int = 8  # the response's budget: all its turns (and, calculator, the tool results in it)
    lr: float = 6e-4
    clip_ratio: float = 0.2
    temperature: float = 1.0
    eval_prompts: int = 64
    eval_samples: int = 16  # per held-out prompt: 1,024 scored answers, a standard error near 1 point at 90 %
    seed: int = 0
    # the trainers' own seed (sampling, TRL's prompt order) when it differs from ``seed``, which keeps
    # the warm start, the prompts and the evaluation: the run-to-run spread of one start (-1: ``seed``)
    rl_seed: int = -1
    threads: int = 2
    repeats: int = 3  # runs per side, alternating which side goes first
    # TRL's generation: generate (transformers' generate, its default) or continuous (transformers'
    # continuous batching, use_transformers_continuous_batching)
    trl_generation: str = "generate"

    @property
    def trainer_seed(self) -> int:
        return self.seed if self.rl_seed < 0 else self.rl_seed


CHOICES = {"task": ("seven", "calculator"), "answer": ("short", "counting"), "trl_generation": ("generate", "continuous")}
# what each task changes of the Settings' defaults (a given option wins)
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "seven": {},
    # a response of a call, its result and the answer; the quickstart's RL learning rate is 5e-5
    # with warmup and a KL loss, neither of which is matched here
    "calculator": {"max_new_tokens": 96, "lr": 1e-4, "eval_prompts": calculator.EVAL_QUESTIONS, "eval_samples": calculator.EVAL_SAMPLES},
}


def _prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Say seven. ({i})"}]


def _rows(start: int, count: int) -> list[dict[str, Any]]:
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": _prompt(i),
            "reward_model": {"style": "rule", "ground_truth": GROUND_TRUTH},
            "extra_info": {"index": i},
            "agent_name": "single_turn",
        }
        for i in range(start, start + count)
    ]


def _answer(number: str, settings: Settings) -> str:
    if settings.answer == "short":
        return number
    if settings.answer == "counting":
        return f"Counting: one, two, three, four, five, six, seven. The answer is {number}."
    raise ValueError(f"--answer must be short or counting, got {settings.answer!r}")


def _reward(text: str) -> float:
    from agentrl.rewards import gsm8k_flexible

    return float(gsm8k_flexible(DATA_SOURCE, text, GROUND_TRUTH))


def _copy_non_weights(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.is_file() and not item.name.endswith((".safetensors", ".bin")):
            shutil.copy2(item, target / item.name)


def warm_start(model_dir: Path, out: Path, settings: Settings) -> Path:
    """A short SFT on demonstrations that answer 7 half of the time: a policy RL can improve."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentrl.trainer.sft import tokenize_conversations

    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    conversations = [
        _prompt(10_000 + i) + [{"role": "assistant", "content": _answer(GROUND_TRUTH if i % 2 else str(i % 7), settings)}]
        for i in range(128)
    ]
    examples = tokenize_conversations(tokenizer, conversations, tools=None, max_length=256)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    supervised(model, examples, pad_token_id=tokenizer.pad_token_id, batch_size=16, lr=3e-3, epochs=2, seed=settings.seed)
    _copy_non_weights(model_dir, out)
    model.save_pretrained(out)
    return out


def evaluate(model_dir: Path, settings: Settings, work: Path) -> float:
    """Mean reward of sampled answers (T = 1, fixed seeds) on held-out prompts."""
    if settings.task == "calculator":
        return calculator.evaluate(model_dir, work, settings)
    from transformers import AutoTokenizer

    from agentrl.engines.base import GenerateRequest, SamplingParams
    from agentrl.engines.builtin import BuiltinEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stop = (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id)

    async def run() -> list[str]:
        async with BuiltinEngine(model_dir, max_batch_size=64, seed=settings.seed) as engine:
            requests = []
            for i in range(settings.eval_prompts):
                ids = tokenizer.apply_chat_template(_prompt(50_000 + i), add_generation_prompt=True, return_dict=True)["input_ids"]
                for k in range(settings.eval_samples):
                    sampling = SamplingParams(
                        max_new_tokens=settings.max_new_tokens, temperature=1.0, stop_token_ids=tuple(set(stop)), seed=i * 1000 + k
                    )
                    requests.append(GenerateRequest(list(ids), sampling))
            results = await asyncio.gather(*(engine.generate(r) for r in requests))
        return [tokenizer.decode(r.output_ids, skip_special_tokens=True) for r in results]

    texts = asyncio.run(run())
    return sum(_reward(t) for t in texts) / len(texts)


def agentrl_config(start: Path, train_file: Path, work: Path, settings: Settings):
    """agentrl's side of the matched settings. ``trainer=default``: the quickstart preset (which
    `agentrl train` loads otherwise) adds a KL loss against a reference model and LR warmup,
    neither of which the TRL side has."""
    from agentrl.config import load_config

    if settings.task == "calculator":
        task = calculator.agentrl_overrides(train_file, settings)
    else:
        task = ["data.task=null", f"data.train_files=[{train_file}]", "agent.default_loop=single_turn",
                "reward.default=gsm8k_flexible", f"rollout.max_new_tokens={settings.max_new_tokens}",
                f"data.max_response_length={settings.max_new_tokens}"]
    overrides = [
        "trainer=default", "algorithm=grpo", f"model.path={start}", "sft.enable=false", *task, f"trainer.total_steps={settings.steps}",
        "trainer.test_freq=0", "trainer.save_freq=0", "trainer.val_before_train=false", "trainer.export_hf=true",
        "trainer.save_rollouts=false",
        f"trainer.seed={settings.trainer_seed}", f"trainer.threads_per_worker={settings.threads}",
        f"data.train_batch_size={settings.prompts}", f"rollout.n={settings.n}",
        f"actor.ppo_mini_batch_size={settings.prompts}", f"actor.ppo_micro_batch_size_per_gpu={settings.prompts * settings.n}",
        f"rollout.temperature={settings.temperature}", f"actor.optim.lr={settings.lr}", f"actor.clip_ratio={settings.clip_ratio}",
        "actor.optim.grad_clip=1.0", "actor.loss_agg_mode=token-mean", "algorithm.norm_adv_by_std_in_grpo=true",
        "logging.progress=false", "logging.loggers=[jsonl]", f"trainer.runs_root={work}", "trainer.run_name=agentrl",
    ]
    cfg = load_config("train", overrides)
    optim = cfg.actor.optim
    if cfg.use_reference or optim.lr_warmup_steps or optim.lr_scheduler != "constant" or optim.betas != (0.9, 0.999):
        raise RuntimeError(f"the benchmark's agentrl config drifted from the matched settings: use_reference="
                           f"{cfg.use_reference}, actor.optim={optim.model_dump()}")
    return cfg


def run_agentrl(start: Path, work: Path, settings: Settings) -> dict[str, Any]:
    from agentrl.data.io import write_rows
    from agentrl.trainer.run import train

    rows = calculator.train_rows(settings) if settings.task == "calculator" else _rows(0, settings.prompts * settings.steps)
    train_file = write_rows(rows, work / "train.parquet")
    cfg = agentrl_config(start, train_file, work, settings)
    started = time.perf_counter()
    result = train(cfg)
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/step_s" in r]
    step_times = [r["timing/step_s"] for r in steps]
    tokens = [r["tokens/sampled"] for r in steps]
    return {
        "step_times": step_times,
        "tokens": tokens,
        "train_rewards": [r["reward/mean"] for r in steps],
        "wall_s": wall,
        "policy": result.run_dir / "policy",
        # where the run's time before its first step went (agentrl train's own breakdown)
        "startup": {k.removeprefix("startup/").removesuffix("_s"): v for k, v in result.summary.items() if k.startswith("startup/")},
    }


def trl_config(settings: Settings, output_dir: Path, **extra: Any):
    """TRL's side of the matched settings: the race's ``GRPOConfig`` (``extra``: the task's keys,
    or what a probe changes, such as the batch of one step). fp32 as agentrl's side: TRL's
    ``bf16`` defaults to on, which on the CPU runs the loss's forward under bf16 autocast."""
    from trl import GRPOConfig

    return GRPOConfig(**{
        "output_dir": str(output_dir), "per_device_train_batch_size": settings.prompts * settings.n, "num_generations": settings.n,
        "gradient_accumulation_steps": 1, "max_completion_length": settings.max_new_tokens, "max_steps": settings.steps,
        "learning_rate": settings.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_grad_norm": 1.0,
        "epsilon": settings.clip_ratio, "beta": 0.0, "loss_type": "dapo", "scale_rewards": "group", "num_iterations": 1,
        "temperature": settings.temperature, "top_p": 1.0, "top_k": 0, "use_cpu": True, "bf16": False, "fp16": False,
        "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": settings.trainer_seed, "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "gradient_checkpointing": False,  # TRL's default is on; agentrl's is off (model.gradient_checkpointing)
        # on the CPU generate is TRL's fastest option (docs/benchmarks.md); continuous batching is measurable
        "use_transformers_continuous_batching": settings.trl_generation == "continuous", **extra,
    })


def run_trl(start: Path, work: Path, settings: Settings) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    torch.set_num_threads(settings.threads)
    tokenizer = AutoTokenizer.from_pretrained(start)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    rows = [{"prompt": _prompt(i)} for i in range(settings.prompts * settings.steps)]

    def seven(completions: list[Any], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [_reward(t) for t in texts]

    reward, tool_args, task_config = seven, {}, {}
    if settings.task == "calculator":  # TRL's own tool loop
        rows, reward, parts = calculator.trl_parts(tokenizer, settings)
        tool_args, task_config = {"tools": parts["tools"]}, parts["config"]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.logs: list[dict[str, float]] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._start)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.logs.append(dict(logs))

    batch = settings.prompts * settings.n
    config = trl_config(settings, work / "trl", **task_config)
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        callbacks=[timer], **tool_args,
    )
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    policy = work / "trl_policy"
    _copy_non_weights(start, policy)
    trainer.model.save_pretrained(policy)
    lengths = [log.get("completions/mean_length", 0.0) for log in timer.logs]
    return {
        "step_times": timer.times,
        "tokens": [length * batch for length in lengths],
        "train_rewards": [log["reward"] for log in timer.logs],
        "wall_s": wall,
        "policy": policy,
    }


def _summary(run: dict[str, Any]) -> dict[str, float]:
    times, tokens = run["step_times"], run["tokens"]
    steady = times[1:] or times
    return {
        "step_s": sum(steady) / len(steady),
        "first_step_s": times[0],
        "tokens_per_s": sum(tokens[1:] or tokens) / sum(steady),
        "train_reward_last": run["train_rewards"][-1],
        "train_wall_s": run["wall_s"],
    }


SIDES = ("agentrl", "trl")
SPREAD_KEYS = ("step_s", "e2e_s", "reward")  # reported with _min, _max and _all besides the median


def _side_order(repeats: int, sides: tuple[str, ...]) -> list[tuple[int, str]]:
    """(repeat, side) in running order: the sides alternate which goes first, so that the
    machine's drift over the run hits both alike (agentrl, trl, trl, agentrl, agentrl, ...)."""
    order = []
    for repeat in range(repeats):
        order += [(repeat, side) for side in (sides if repeat % 2 == 0 else sides[::-1])]
    return order


def _run_side_process(side: str, start: Path, work: Path, settings: Settings) -> dict[str, Any]:
    """One side's training as a process of its own, timed from before the interpreter starts
    to its exit: start-up (imports, model load) included."""
    argv = [sys.executable, "-m", "agentrl_benchmarks.trainer", "--side", side, "--start", str(start), "--work", str(work)]
    for name, value in asdict(settings).items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    timeout_s = 600 + 120 * settings.steps  # far above a real run's time, even on a loaded 2-core machine
    started = time.perf_counter()
    try:
        done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout_s)  # progress: our stderr
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the {side} side did not finish within {timeout_s} s (killed; its output is above on stderr)") from None
    e2e = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"the {side} side exited with {done.returncode} (its output is above on stderr)")
    run = json.loads(done.stdout.strip().splitlines()[-1])
    run["policy"], run["e2e_s"] = Path(run["policy"]), e2e
    return run


def _binomial_se(reward: float, answers: int) -> float:
    """The standard error of a mean of ``answers`` scores of 0 or 1 whose mean is ``reward``."""
    return (reward * (1 - reward) / answers) ** 0.5


def _spread(values: list[float]) -> dict[str, Any]:
    return {"": statistics.median(values), "_min": min(values), "_max": max(values), "_all": values}


def _run_both(settings: Settings, work: Path, *, with_trl: bool, with_agentrl: bool = True) -> dict[str, Any]:
    """``settings.repeats`` runs per side, alternating. The keys of one run (step time, reward,
    ...) hold the median over the repeats; ``*_min``, ``*_max`` and ``*_all`` the spread."""
    from agentrl.tiny import tiny_model_dir

    if settings.task == "calculator":
        start = calculator.warm_start(work / "start", settings)
    else:
        start = warm_start(tiny_model_dir(settings.model_size, seed=settings.seed), work / "start", settings)
    out: dict[str, Any] = {"settings": asdict(settings), "start_reward": evaluate(start, settings, work / "eval-start")}
    sides = tuple(side for side, on in zip(SIDES, (with_agentrl, with_trl)) if on)
    order = _side_order(settings.repeats, sides)
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    for repeat, side in order:
        print(f"# repeat {repeat + 1}/{settings.repeats}: {side}", file=sys.stderr)
        run = _run_side_process(side, start, work / f"{side}-{repeat}", settings)
        run["reward"] = evaluate(run["policy"], settings, work / f"eval-{side}-{repeat}")
        runs[side].append(run)
    out["repeats"], out["order"] = settings.repeats, [side for _, side in order]
    out["eval_answers"] = answers = settings.eval_prompts * settings.eval_samples
    # each answer scores 0 or 1: a held-out figure's own sampling error is binomial
    out["start_reward_se"] = _binomial_se(out["start_reward"], answers)
    for side, side_runs in runs.items():
        summaries = [
            _summary(run) | {"e2e_s": run["e2e_s"], "outside_train_s": run["e2e_s"] - run["wall_s"], "reward": run["reward"]}
            for run in side_runs
        ]
        for key in summaries[0]:
            values = [summary[key] for summary in summaries]
            if key in SPREAD_KEYS:
                out.update({f"{side}_{key}{suffix}": value for suffix, value in _spread(values).items()})
            else:
                out[f"{side}_{key}"] = statistics.median(values)
        out[f"{side}_reward_se"] = _binomial_se(out[f"{side}_reward"], answers)
        out[f"{side}_train_rewards"] = side_runs[0]["train_rewards"]  # the first repeat's, step by step
        out[f"{side}_omp_wait_policy_all"] = [run.get("omp_wait_policy") for run in side_runs]
        if "startup" in side_runs[0]:  # agentrl's start-up phases, each the median over the repeats
            out[f"{side}_startup_s"] = {phase: statistics.median(run["startup"][phase] for run in side_runs)
                                        for phase in side_runs[0]["startup"]}
    if with_trl:
        import trl

        out["trl_version"] = trl.__version__
    if with_trl and with_agentrl:
        out["ratio"] = out["trl_step_s"] / out["agentrl_step_s"]
        out["e2e_ratio"] = out["trl_e2e_s"] / out["agentrl_e2e_s"]
    return out


def _side_main(side: str, start: Path, work: Path, settings: Settings) -> int:
    """The child of ``_run_side_process``: one side's training, one JSON line on stdout."""
    import torch

    torch.set_num_threads(settings.threads)
    work.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON line (TRL logs there)
        run = (run_agentrl if side == "agentrl" else run_trl)(start, work, settings)
    print(json.dumps(run | {"policy": str(run["policy"]), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default")}))
    if side == "agentrl":  # the side stands for `agentrl train`'s process, which ends this way
        from agentrl.cli import skip_the_last_collection

        sys.stdout.flush()
        skip_the_last_collection()
    return 0


@contextlib.contextmanager
def _cpu_job(on: bool):
    """``--beside-cpu-job``: one Python busy loop for as long as the block runs (started before the
    warm start, so the machine's load average has risen by the first side's start)."""
    job = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if on else None
    try:
        yield
    finally:
        if job is not None:
            job.kill()
            job.wait()


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentrl bench trainer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print only the JSON object")
    defaults = Settings()
    for name, value in asdict(defaults).items():
        choices = CHOICES.get(name)
        # a key with a task's own default is None until the task is known
        default = None if any(name in task for task in TASK_DEFAULTS.values()) else value
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=default, choices=choices)
    parser.add_argument("--skip-trl", action="store_true", help="run agentrl only (TRL not installed)")
    parser.add_argument("--skip-agentrl", action="store_true", help="run TRL only (its spread over --rl-seed)")
    parser.add_argument("--keep", help="keep the work directory here instead of a temporary one")
    parser.add_argument("--beside-cpu-job", action="store_true",
                        help="a Python busy loop shares the cores for the whole benchmark (a machine shared with another job)")
    # one side's training in a process of its own (what the benchmark runs; not for direct use)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    given = {name: getattr(args, name) for name in asdict(defaults) if getattr(args, name) is not None}
    settings = Settings(**{**TASK_DEFAULTS[args.task], **given})
    if args.skip_trl and args.skip_agentrl:
        parser.error("--skip-trl and --skip-agentrl leave nothing to run")
    if settings.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {settings.repeats}")
    if settings.task == "calculator" and settings.model_size != "1m":
        parser.error("--task calculator starts from the calculator-skilled 1m base: --model-size must be 1m")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.side:
        if args.side == "agentrl":  # what `agentrl train` does as it starts, before torch loads
            from agentrl.cli import shared_machine_wait_policy
            from agentrl.trainer.startup import pause_collector

            shared_machine_wait_policy()
            pause_collector()  # resumed by the trainer once its models are loaded, as in `agentrl train`
        return _side_main(args.side, args.start, args.work, settings)
    if not args.skip_trl:
        try:
            import trl  # noqa: F401
        except ImportError:
            print("TRL is not installed: pip install 'agentrl[bench]' (or pass --skip-trl)", file=sys.stderr)
            return 2
    import torch

    torch.set_num_threads(settings.threads)
    # stdout carries only the JSON object.
    with scratch_dir("trainer", keep=args.keep) as work, private_ray_temp_dir(), contextlib.redirect_stdout(sys.stderr), \
            _cpu_job(args.beside_cpu_job):
        out = _run_both(settings, work, with_trl=not args.skip_trl, with_agentrl=not args.skip_agentrl)
    out["beside_cpu_job"] = args.beside_cpu_job
    out = {k: _rounded(v) for k, v in out.items()}
    if not args.json:
        print(f"agentrl {out.get('agentrl_step_s', float('nan')):.3f} s/step, {out.get('agentrl_e2e_s', float('nan')):.1f} s end to end; "
              f"TRL {out.get('trl_step_s', float('nan')):.3f} s/step, {out.get('trl_e2e_s', float('nan')):.1f} s end to end", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
