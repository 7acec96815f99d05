"""`python -m worker COMMAND ...`: the measurement library without the site or a database.

Each command lives in its own module, which provides ``add_cli_arguments(parser)`` and
``cli(args) -> int``.
"""
import argparse
import importlib
import sys

COMMANDS = {
    "measure": ("worker.measure", "measure a drafter (or the baseline) under a protocol file"),
    "generate": ("worker.generate", "generate with the reference engine and print the step trace"),
    "validate": ("worker.checkpoint.cli", "validate a drafter checkpoint as an upload would be"),
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m worker", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_cli_arguments(p)
    args = parser.parse_args(argv)
    return importlib.import_module(args._module).cli(args)


if __name__ == "__main__":
    sys.exit(main())
