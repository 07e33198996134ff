"""What the entry points share: bad input reported as one line, and a console a person can read.

    def main(argv=None) -> int:
        return run_main(_main, parse_args(argv))       # UserInputError -> "error: <message>" on stderr, status 2

    def _main(args) -> int:
        configure_console(args.verbose)                 # our own progress (nemo_grpo.*) on stderr
        cfg = load_config(args.config, args.overrides)
        log_file = log_to_file(prepare_log_dir(cfg.logger.log_dir), args.verbose)  # everything, in run.log
        trainer = build_trainer(cfg, log_to_driver=args.verbose)   # quiet: init_ray calls quiet_libraries()
        ...

Without --verbose the console shows the nemo_grpo.* loggers (INFO and up) and anyone's errors; everything
logged in this process, third-party libraries and Python warnings included, also goes to <log_dir>/run.log.
Libraries that print through stderr handlers of their own (torch, transformers, ray...) are sent through the
root logger instead by quiet_libraries, which reaches the libraries imported when it runs (log_to_file and
init_ray(log_to_driver=False) call it: by then the driver has imported what it uses). The Ray workers' output
is the caller's to route (`init_ray(log_to_driver=verbose)`): not forwarded, it stays in Ray's session
directory (init_ray logs where).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, Callable, Optional

from nemo_grpo.config import to_yaml
from nemo_grpo.errors import UserInputError

EXIT_USER_ERROR = 2  # the exit status for bad input (argparse uses it for bad arguments too)
LOG_FILE = "run.log"
OWN_LOGGERS = ("nemo_grpo", "__main__")
FILE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


# ----------------------------------------------------------------------------------------------- bad input
def error_line(error: BaseException) -> str:
    """`error: <message>` on one line. A UserInputError raised inside a Ray actor arrives wrapped; its own
    message is used, not the remote traceback around it."""
    while isinstance(getattr(error, "cause", None), UserInputError):
        error = error.cause
    message = str(error.args[0]) if len(error.args) == 1 else str(error)
    return "error: " + " ".join(line.strip() for line in message.splitlines() if line.strip())


def entry_point_parser(prog: str, config_help: str, log_place: str, override_example: str,
                       **kwargs: Any) -> argparse.ArgumentParser:
    """The arguments every run's entry point takes: --config, --print-config, --verbose (third-party output on
    the console instead of `log_place` and Ray's session logs) and dotted overrides."""
    parser = argparse.ArgumentParser(prog=prog, formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)
    parser.add_argument("--config", help=config_help)
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--verbose", action="store_true", help="show third-party output (vLLM, Ray workers, "
                        f"transformers) on the console instead of {log_place} and Ray's session logs")
    parser.add_argument("overrides", nargs="*", help=f"dotted overrides, e.g. {override_example}")
    return parser


def resolved_config(args: argparse.Namespace, load: Callable[[Optional[str], list[str]], Any]) -> Any:
    """The console set up (configure_console), then `load(args.config, args.overrides)`: the validated config,
    or None once --print-config has printed it."""
    configure_console(args.verbose)
    cfg = load(args.config, args.overrides)
    if args.print_config:
        print(to_yaml(cfg))
        return None
    return cfg


def run_main(body: Callable[..., Optional[int]], *args: Any, **kwargs: Any) -> int:
    """Run an entry point's body and return its exit status (None counts as 0). A UserInputError (ConfigError,
    DataError), wherever it is raised, becomes one line on stderr and status 2, without a traceback; any
    other exception is a bug and propagates with its traceback."""
    try:
        status = body(*args, **kwargs)
    except UserInputError as e:
        sys.stdout.flush()
        print(error_line(e), file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    return 0 if status is None else int(status)


# ----------------------------------------------------------------------------------------------- console
class _OursOnConsole(logging.Filter):
    """Quiet console: records of our own loggers, and errors of anyone's."""

    def filter(self, record: logging.LogRecord) -> bool:
        name = record.name
        ours = name in OWN_LOGGERS or name.startswith(tuple(f"{o}." for o in OWN_LOGGERS))
        return ours or record.levelno >= logging.ERROR


class _ConsoleHandler(logging.Handler):
    """stderr through tqdm.write, so that a line logged while the progress bar runs lands above the bar
    instead of inside it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm  # here: the entry points import this module for a config error, tqdm ~60 ms

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


class _ConsoleFormatter(logging.Formatter):
    """"12:03:04 message"; the level is named from WARNING up."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return f"{self.formatTime(record, '%H:%M:%S')} " + (
            f"{record.levelname} {record.name}: {text}" if record.levelno >= logging.WARNING else text)


def configure_console(verbose: bool = False) -> None:
    """The root logger at INFO with one console handler on stderr: quiet (our loggers, anyone's errors), or
    verbose (every record). Replaces handlers set by an earlier call or by logging.basicConfig."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _ConsoleHandler) or type(handler) is logging.StreamHandler:
            root.removeHandler(handler)
    handler = _ConsoleHandler()
    handler.setFormatter(_ConsoleFormatter("%(message)s"))
    if not verbose:
        handler.addFilter(_OursOnConsole())
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger: run.log, or the console if verbose


def log_to_file(log_dir: str, verbose: bool = False) -> str:
    """Append every record of this process (INFO and up) to <log_dir>/run.log (log_dir exists:
    logger.prepare_log_dir); quiet, quiet_libraries() too. Returns the file's path."""
    path = os.path.join(log_dir, LOG_FILE)
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and handler.baseFilename == os.path.abspath(path):
            root.removeHandler(handler)
            handler.close()
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FILE_FORMAT))
    root.addHandler(handler)
    if not verbose:
        quiet_libraries()
    return path


def quiet_libraries() -> list[str]:
    """Every logger of an imported library that prints through a stderr handler of its own (torch, transformers,
    ray, huggingface_hub do) loses that handler and logs through the root logger instead: to run.log, and to
    the console only from ERROR up. Libraries imported later keep theirs: call again once they are imported.
    Returns the names of the loggers changed."""
    changed = []
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or name.split(".")[0] in OWN_LOGGERS:
            continue
        printing = [h for h in logger.handlers
                    if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)]
        for handler in printing:
            logger.removeHandler(handler)
        if printing:
            logger.propagate = True
            changed.append(name)
    return changed
