import sys

from django.core.management.base import BaseCommand, CommandError

from leaderboard.services.setup import ServiceError
from leaderboard.services.training import find_target, make_training_data
from worker.training.data import TrainingDataError


class Command(BaseCommand):
    help = ("Write shared training data: conversations of the target itself (it writes the "
            "questions too, or answers --prompts FILE), versioned and hashed.")

    def add_arguments(self, parser):
        parser.add_argument("--target", required=True, help="target slug")
        parser.add_argument("--n", type=int, required=True, help="number of conversations")
        parser.add_argument("--slug", help="dataset name (default: TARGET-self-chat, TARGET-starts-chat "
                            "or TARGET-prompts-chat)")
        parser.add_argument("--prompts", help="JSON lines of user prompts to answer instead of "
                            "generated questions (strings, or objects with prompt/text/question/turns)")
        parser.add_argument("--question-starts", metavar="FILE",
                            help="JSON lines of strings: openings of the user turn that the "
                                 "target continues into its questions, taken in turn (e.g. "
                                 "training-data/question-starts.jsonl, openings by task type)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--max-question-tokens", type=int, default=48)
        parser.add_argument("--max-answer-tokens", type=int, default=192)
        parser.add_argument("--answer-temperature", type=float, default=0.0,
                            help="0 (default): the target's greedy answers")
        parser.add_argument("--engine", choices=["vllm", "reference"], default="vllm",
                            help="vllm (default: the engine of record, many sequences in flight) "
                                 "or the reference engine")
        parser.add_argument("--batch-size", type=int, default=None,
                            help="conversations per round, generated together and kept when "
                                 "done (default 256 with vllm, 16 with reference)")
        parser.add_argument("--skip-existing", action="store_true",
                            help="keep the slug's newest version if there is one (generate nothing)")

    def handle(self, *args, **o):
        from tqdm import tqdm

        bars = {}

        def progress(event):
            what, done, total = event
            bar = bars.get(what)
            if bar is None:
                bar = bars[what] = tqdm(total=total, initial=done, desc=what, unit="conv",
                                        file=sys.stderr, smoothing=0.1)
            bar.update(done - bar.n)

        try:
            target = find_target(o["target"])
            row, created = make_training_data(
                target, o["n"], slug=o["slug"], prompts_file=o["prompts"], seed=o["seed"],
                max_question_tokens=o["max_question_tokens"],
                max_answer_tokens=o["max_answer_tokens"],
                answer_temperature=o["answer_temperature"], batch_size=o["batch_size"],
                engine=o["engine"], skip_existing=o["skip_existing"],
                question_starts_file=o["question_starts"], progress=progress,
                say=lambda m: self.stderr.write(m))
        except (ServiceError, TrainingDataError) as e:
            raise CommandError(f"{e}\nNo dataset was recorded.") from None
        finally:
            for bar in bars.values():
                bar.close()
        stats = row.params.get("stats", {})
        verb = "written" if created else "already present (nothing new written)"
        self.stdout.write(self.style.SUCCESS(
            f"training data {row.slug} v{row.version}: {verb}; {row.n} conversations, "
            f"{row.tokens} tokens, sha256 {row.sha256}"))
        self.stdout.write(f"  stored as {row.path}; {stats}")
