from django.core.management.base import BaseCommand, CommandError

from leaderboard.services.runs import queue_if_no_run
from leaderboard.services.setup import ServiceError
from leaderboard.services.training import (find_dataset, find_protocol, find_target, train_and_register,
                                  trained_drafter)
from worker.training import RECIPES, ResumeError


class Command(BaseCommand):
    help = ("Train a baseline drafter with a recipe on shared training data, register it as a "
            "drafter and queue its measurement.")

    def add_arguments(self, parser):
        parser.add_argument("--recipe", required=True, choices=sorted(RECIPES))
        parser.add_argument("--target", required=True, help="target slug")
        parser.add_argument("--data", required=True, help="training data slug (or SLUG@VERSION)")
        parser.add_argument("--protocol", help="protocol to queue the run under (SLUG or "
                            "SLUG@VERSION; default: the target's newest)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--steps", type=int, help="optimizer steps (default: the recipe's)")
        parser.add_argument("--batch-size", type=int)
        parser.add_argument("--lr", type=float)
        parser.add_argument("--layers", type=int, help="draft_model: target layers kept (default 4)")
        parser.add_argument("--unroll", type=int, help="eagle_multistep, eagle3: steps unrolled "
                            "(default 3, resp. 2)")
        parser.add_argument("--heads", type=int, help="medusa, medusa_reduced_vocab: number of "
                            "heads (default: the protocol's largest k, at least 3)")
        parser.add_argument("--draft-vocab", type=int, help="medusa_reduced_vocab, eagle3: the most "
                            "frequent answer tokens it drafts over (default 4096)")
        parser.add_argument("--out", help="training folder (default: DATA_DIR/training-runs/...)")
        parser.add_argument("--resume", action="store_true", help="continue from the folder's checkpoint")
        parser.add_argument("--resume-if-any", action="store_true",
                            help="continue from the folder's checkpoint when there is one")
        parser.add_argument("--checkpoint-minutes", type=float, default=5.0)
        parser.add_argument("--skip-existing", action="store_true",
                            help="do nothing when this recipe, data, seed (and --heldout) are already "
                                 "registered")
        parser.add_argument("--heldout", type=int, default=0,
                            help="leave the data's last N conversations out of training and "
                                 "report the drafter's top-1 on them beside its top-1 on as "
                                 "many training conversations (over-fitting; default 0)")
        parser.add_argument("--no-progress", action="store_true")

    def handle(self, *args, **o):
        recipe = o["recipe"]
        options = {"layers": o["layers"], "unroll": o["unroll"], "heads": o["heads"],
                   "draft_vocab": o["draft_vocab"]}
        allowed = RECIPES[recipe].options
        wrong = [k for k, v in options.items() if v is not None and k not in allowed]
        if wrong:
            raise CommandError(f"--{wrong[0]} does not apply to the {recipe} recipe")
        try:
            target = find_target(o["target"])
            dataset = find_dataset(o["data"])
            protocol = find_protocol(o["protocol"], target)
            if o["skip_existing"]:
                existing = trained_drafter(recipe, dataset, o["seed"], o["heldout"])
                if existing is not None:
                    self.stdout.write(f"{recipe}: already registered as {existing.slug}; skipped")
                    # measured under the protocol asked for all the same (a shipped drafter
                    # has no run under demo-cpu-acceptance until a learning curve asks)
                    run = queue_if_no_run(protocol, existing)
                    if run is not None:
                        self.stdout.write(queued_line(run))
                    return
            summary, drafter, run = train_and_register(
                recipe, target, dataset, protocol, seed=o["seed"], steps=o["steps"],
                batch_size=o["batch_size"], lr=o["lr"], options=options, out_dir=o["out"],
                resume=o["resume"] or ("if_any" if o["resume_if_any"] else False),
                checkpoint_minutes=o["checkpoint_minutes"],
                progress=not o["no_progress"], say=self.stdout.write, heldout=o["heldout"])
        except (ServiceError, ResumeError, ValueError) as e:
            raise CommandError(str(e)) from None
        self.stdout.write(
            f"{recipe}: {summary['steps']} steps in {summary['seconds']:.0f} s, loss "
            f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}"
            + (f", top-1 on the training data {summary['final_top1']:.3f}"
               if summary.get("final_top1") is not None else ""))
        self.stdout.write(self.style.SUCCESS(
            f"registered drafter {drafter.slug} ({drafter.method}); {queued_line(run)}"))


def queued_line(run) -> str:
    return f"run {run.pk} queued under {run.protocol} on {run.hardware}"
