"""Apply deliberate bugs one at a time, run only the tests meant to catch each, and restore the code.

    .venv/bin/python scripts/mutation_check.py                # every mutation
    .venv/bin/python scripts/mutation_check.py --only kl_k3_drops_the_minus_one positions_response_shift

Each mutation replaces one exact piece of source text (which must occur exactly once, so a
refactor that moves the code makes the check fail loudly instead of testing nothing), runs its
tests with ``pytest -x -q``, and puts the file back byte for byte, also on Ctrl-C. A mutation is
*caught* when pytest fails. Prints one JSON object per mutation and a summary; exits 1 if any
mutation survived or could not be applied. The table in docs/testing.md comes from this output.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    area: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTATIONS = [
    Mutation("positions_response_shift", "positions", "agentrl/trainer/packed.py",
             "fed_ids, fed_positions = ids.gather(1, source), positions.gather(1, source)",
             "fed_ids, fed_positions = ids.gather(1, source), positions.gather(1, source) + (column >= prompt[:, None])",
             ("tests/trainer/test_logprob_agreement.py",)),
    Mutation("positions_from_one", "positions", "agentrl/trainer/batch.py",
             "position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)",
             "position_ids = attention_mask.cumsum(dim=1).clamp(min=0)",
             ("tests/trainer/test_batch.py", "tests/trainer/test_logprob_agreement.py")),
    Mutation("response_mask_keeps_padding", "masks", "agentrl/trainer/batch.py",
             "mask_rows.append(list(mask) + [0] * right)", "mask_rows.append(list(mask) + [1] * right)",
             ("tests/trainer/test_batch.py",)),
    Mutation("masked_mean_ignores_mask", "masks", "agentrl/trainer/algorithms/masked.py",
             "return (x * mask).sum() / mask.sum().clamp(min=1)", "return x.sum() / mask.sum().clamp(min=1)",
             ("tests/trainer/test_algorithms.py",)),
    Mutation("grpo_no_std_division", "advantages", "agentrl/trainer/algorithms/advantages.py",
             "return centered / (std + eps) if norm_by_std else centered",
             "return centered",
             ("tests/trainer/test_algorithms.py",)),
    Mutation("grpo_biased_std", "advantages", "agentrl/trainer/algorithms/advantages.py",
             "std = (squares / (count - 1).clamp(min=1)).sqrt()", "std = (squares / count.clamp(min=1)).sqrt()",
             ("tests/trainer/test_algorithms.py",)),
    Mutation("kl_k3_drops_the_minus_one", "KL", "agentrl/trainer/algorithms/kl.py",
             "return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)",
             "return (torch.exp(log_ratio) - log_ratio).clamp(-10, 10)",
             ("tests/trainer/test_algorithms.py",)),
    Mutation("adaptive_kl_inverted_error", "KL", "agentrl/trainer/algorithms/kl.py",
             "error = max(-0.2, min(0.2, current_kl / self.target - 1))",
             "error = max(-0.2, min(0.2, self.target / max(current_kl, 1e-12) - 1))",
             ("tests/trainer/test_algorithms.py",)),
    Mutation("importance_ratio_inverted", "importance ratios", "agentrl/trainer/algorithms/losses.py",
             "log_ratio = (logprob - old_logprob).clamp(-20.0, 20.0)\n    ratio = torch.exp(log_ratio)\n    unclipped",
             "log_ratio = (old_logprob - logprob).clamp(-20.0, 20.0)\n    ratio = torch.exp(log_ratio)\n    unclipped",
             ("tests/trainer/test_algorithms.py",)),
    Mutation("clip_bounds_swapped", "clipping", "agentrl/trainer/algorithms/losses.py",
             "unclipped = -advantages * ratio\n    clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)\n    pessimistic",
             "unclipped = -advantages * ratio\n    clipped = -advantages * ratio.clamp(1 - clip_ratio_high, 1 + clip_ratio_low)\n    pessimistic",
             ("tests/trainer/test_algorithms.py",)),
    Mutation("seq_mean_token_mean_is_a_sum", "loss aggregation", "agentrl/trainer/algorithms/losses.py",
             "per_seq = per_seq_sum / mask.sum(-1).clamp(min=1)", "per_seq = per_seq_sum",
             ("tests/trainer/test_algorithms.py",)),
    Mutation("micro_batch_scale_ignores_world_size", "gradient accumulation", "agentrl/trainer/rank.py",
             "return loss_denominator(mask, mode) / max(global_denominator, 1.0) * world_size",
             "return loss_denominator(mask, mode) / max(global_denominator, 1.0)",
             ("tests/trainer/test_gradient_scale.py",)),
    Mutation("micro_batch_scale_is_one", "gradient accumulation", "agentrl/trainer/rank.py",
             "return loss_denominator(mask, mode) / max(global_denominator, 1.0) * world_size",
             "return 1.0 * world_size",
             ("tests/trainer/test_gradient_scale.py",)),
    Mutation("weight_update_dropped", "weight sync", "agentrl/engines/_scheduler.py",
             "                copy_weights_into(self.model, update.state_dict, strict=update.strict)\n",
             "                pass\n",
             ("tests/engines/test_builtin.py::test_state_dict_update_changes_outputs_to_the_new_weights",)),
    Mutation("unknown_tool_dispatched", "tool dispatch", "agentrl/agent/tools_runtime.py",
             "        if name not in self.enabled:\n            known",
             "        if False:\n            known",
             ("tests/agent/test_policies_and_limits.py",)),
    Mutation("observation_content_dropped", "observation rendering", "agentrl/agent/render.py",
             'parts.append(message.get("content") or "")', 'parts.append("")',
             ("tests/agent/test_templates.py",)),
    Mutation("observation_eos_separator_kept", "observation rendering", "agentrl/agent/render.py",
             "text = text[len(self.separator) :]", "text = text",
             ("tests/agent/test_templates.py",)),
    Mutation("dataset_resume_restarts_the_epoch", "resume", "agentrl/data/dataset.py",
             'return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "num_rows": self.num_rows}',
             'return {"epoch": self.epoch, "offset": 0, "seed": self.seed, "num_rows": self.num_rows}',
             ("tests/data/test_dataset.py",)),
]


def apply(mutation: Mutation) -> str:
    path = ROOT / mutation.file
    original = path.read_text()
    count = original.count(mutation.old)
    if count != 1:
        raise SystemExit(f"{mutation.name}: the text to mutate occurs {count} times in {mutation.file} (expected once)")
    path.write_text(original.replace(mutation.old, mutation.new))
    return original


def run(mutation: Mutation, timeout_s: float) -> dict:
    path = ROOT / mutation.file
    original = apply(mutation)
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-n", "0", "-x", "-q", "-p", "no:cacheprovider", *mutation.tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        outcome = "caught" if done.returncode != 0 else "survived"
        failed = [line.split(" ")[1] for line in done.stdout.splitlines() if line.startswith("FAILED ")]
    except subprocess.TimeoutExpired:
        outcome, failed = "timeout", []
    finally:
        path.write_text(original)
    return {"mutation": mutation.name, "area": mutation.area, "file": mutation.file, "outcome": outcome,
            "caught_by": failed[:1], "tests_run": list(mutation.tests), "seconds": round(time.monotonic() - start, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutation names to run (default: all)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per mutation's test run")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.only and len(chosen) != len(args.only):
        raise SystemExit(f"unknown mutation(s): {sorted(set(args.only) - {m.name for m in MUTATIONS})}")
    results = []
    for mutation in chosen:
        result = run(mutation, args.timeout)
        results.append(result)
        print(json.dumps(result), flush=True)
    survivors = [r["mutation"] for r in results if r["outcome"] != "caught"]
    print(json.dumps({"mutations": len(results), "caught": len(results) - len(survivors), "not_caught": survivors}))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
