"""The `regen` command (also `python -m pipeline`). Errors go to stderr with a non-zero exit."""
from __future__ import annotations

import argparse
import os
import signal
import sys

from .core import exits
from .core.errors import RegenError
from .store.memory import choose_arrow_pool


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def _generate(args: argparse.Namespace) -> int:
    from .run import GenerateOptions, generate

    return generate(GenerateOptions(args.config, args.new_run, args.refresh_prompts, args.retry_failures,
                                    start_with_passing=args.start_with_passing, run_dir=args.run_dir,
                                    add_samples=args.add_samples))


def _capture(args: argparse.Namespace) -> int:
    from .capture import CaptureOptions, capture

    return capture(CaptureOptions(args.run_dir, args.config, args.force))


def _status(args: argparse.Namespace) -> int:
    from .store.status import print_status

    try:
        code = print_status(args.run_dir, as_json=args.json)
        sys.stdout.flush()  # here, so that a reader that left is seen inside the try
        return code
    except BrokenPipeError:  # `regen status RUN | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush must not fail
        return 0


def _validate(args: argparse.Namespace) -> int:
    from .prompts.validate import ValidateOptions, validate

    return validate(ValidateOptions(args.config, secrets=not args.no_secrets, offline=args.offline))


def _card(args: argparse.Namespace) -> int:
    from .export.card import run_card  # matplotlib is imported only for this command

    return run_card(args)


def _preflight(args: argparse.Namespace) -> int:
    from .dispatch.prompt_needs import prompt_needs
    from .endpoints.preflight import run_preflight_command

    return run_preflight_command(args.config, prompt_needs)


def _serve_local(args: argparse.Namespace) -> int:
    from .endpoints.localfleet import main as serve_main

    return serve_main(args.rest)


def _emulate(args: argparse.Namespace) -> int:
    from .emulator import main as emulator_main

    return emulator_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="regen", description="Regenerate draft-model training data through a fleet of SGLang servers."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="run (or resume) a regeneration", description=(
        "Run the config's prompts through its endpoints into a run directory. Running it again resumes."))
    gen.add_argument("--config", default=os.environ.get("CONFIG", "configs/local.yaml"),
                     help="run config (YAML); default: $CONFIG, else configs/local.yaml")
    which = gen.add_mutually_exclusive_group()
    which.add_argument("--new-run", action="store_true",
                       help="resume the newest run of this name only if nothing of its identity changed (generation "
                            "and prompt-set config, the weights the fleet serves); else start a successor <run>-rN")
    which.add_argument("--run-dir", metavar="DIR",
                       help="the run directory to resume (default: the newest run of the config's run_name whose "
                            "identity matches the config); the drift guard still applies")
    gen.add_argument("--refresh-prompts", action="store_true",
                     help="re-read the sources: new prompts are added, done ones never sent again")
    gen.add_argument("--retry-failures", action="store_true", help="send terminal failures again")
    gen.add_argument("--add-samples", action="store_true",
                     help="resume a run whose config raises samples_per_prompt: only the new samples of each prompt "
                          "are sent, and run.json records the new value (lowering it is always refused)")
    gen.add_argument("--start-with-passing", action="store_true",
                     help="when the preflight refuses some endpoints for problems of their own, start with the ones "
                          "that pass instead of refusing the run; the others are named in the log and status and "
                          "join once they pass the preflight (a fleet split between models or weights is still "
                          "refused)")
    gen.set_defaults(func=_generate)

    cap = sub.add_parser("capture", help="capture the hidden states of a run's committed records", description=(
        "A prefill-only pass over each committed record's prompt + completion ids (route transformers: in "
        "process; route vllm: the server's hidden-states files), into RUN/capture/. Running it again resumes; "
        "it may run beside a live generation."))
    cap.add_argument("run_dir", help="a run directory (outputs/<run>)")
    cap.add_argument("--config", required=True, help="capture config (YAML): route, model, layers, actors")
    cap.add_argument("--force", action="store_true",
                     help="start even if the estimated size of the states exceeds the free disk space")
    cap.set_defaults(func=_capture)

    status = sub.add_parser("status", help="progress of a run, counted from its ledger",
                            description="Counts from committed parts, so it is right during a run and after a crash.")
    status.add_argument("run_dir", help="a run directory (outputs/<run>, or an s3:// or gs:// URI)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(func=_status)

    preflight = sub.add_parser("preflight", help="probe every endpoint and print a table; send no prompt",
                               description="Check every endpoint's model identity, weight version, context, "
                                           "reasoning and tool-call parser, token ids and batch, and the fleet as "
                                           "a whole, against the prompt set the run will send (its tools, images "
                                           "and longest prompt): the stored one when the run exists, else the "
                                           "sources. Exits 0 (passed), 1 (refused) or 2 (bad config or source).")
    preflight.add_argument("config")
    preflight.set_defaults(func=_preflight)

    validate = sub.add_parser("validate", help="check a config and read the first records of each source",
                              description="Check a config, and read the first records of each source to say what "
                                          "they are (a hub dataset is streamed); contacts no endpoint. Exits as "
                                          "`regen generate` would: 2 for a source it refuses or an unset "
                                          "api_key_env.")
    validate.add_argument("config")
    validate.add_argument("--no-secrets", action="store_true",
                          help="do not check that each endpoint's api_key_env is set (a cluster's config on a laptop)")
    validate.add_argument("--offline", action="store_true",
                          help="contact nothing: hub datasets are not probed (as with HF_HUB_OFFLINE=1; an "
                               "unreachable hub is skipped too, after a 3 s connect)")
    validate.set_defaults(func=_validate)

    from .export.command import add_export_arguments, run_export

    export = sub.add_parser("export", help="training files from a run (SpecForge, speculators, TorchSpec)",
                            description="Write a run's committed records in a training library's format, atomically.")
    add_export_arguments(export)
    export.set_defaults(func=run_export)
    card = sub.add_parser("card", help="write the run's dataset card (README.md + histograms)",
                          description="Write RUN_DIR/README.md: model, sources, finish reasons, quality flags, "
                                      "token statistics, endpoint shares, and PNG histograms in RUN_DIR/card/.")
    card.add_argument("run_dir", help="a run directory (outputs/<run>)")
    card.set_defaults(func=_card)

    for name, func, text in (("serve-local", _serve_local, "serve SmolLM2-135M with llama.cpp (one server)"),
                             ("emulate", _emulate, "run the SGLang-faithful emulator"),
                             ("simulate", _simulate, "dry-run a config against N emulated endpoints; predict "
                                                     "wall time, tokens and disk"),
                             ("bench-endpoints", _bench_endpoints, "decode tok/s and speculative accept length "
                                                                   "of each endpoint")):
        command = sub.add_parser(name, help=text, add_help=False)
        command.add_argument("rest", nargs=argparse.REMAINDER)
        command.set_defaults(func=func)
    return parser


def _simulate(args: argparse.Namespace) -> int:
    from .tools.simulate import main as simulate_main

    return simulate_main(args.rest)


def _bench_endpoints(args: argparse.Namespace) -> int:
    from .tools.bench_endpoints import main as bench_main

    return bench_main(args.rest)


PASSTHROUGH = {"serve-local": _serve_local, "emulate": _emulate, "simulate": _simulate,
               "bench-endpoints": _bench_endpoints}  # these parse their own options


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["generate"], ["capture"]) and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _interrupt)  # 130 from the start; the run installs its own handler later
    try:
        if argv and argv[0] in PASSTHROUGH:
            args = argparse.Namespace(func=PASSTHROUGH[argv[0]], rest=argv[1:])
        else:
            args = build_parser().parse_args(argv)
            choose_arrow_pool()  # before the command's first Arrow read (store/memory.py says why)
        return args.func(args)
    except RegenError as exc:
        print(f"regen: error: {exc}", file=sys.stderr)
        return exits.for_error(exc)
    except KeyboardInterrupt:
        print("regen: interrupted", file=sys.stderr)
        return exits.INTERRUPTED.code
