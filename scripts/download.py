"""Download a model or dataset from the Hugging Face hub, then print the command to fine-tune on it.

    python scripts/download.py meta-llama/Llama-2-7b-hf
    python scripts/download.py meta-llama/Meta-Llama-3-8B --format meta --output-dir /data/llama3-8b
    python scripts/download.py yahma/alpaca-cleaned --repo-type dataset

By default a model gives one copy of its weights (safetensors when the repository has both
safetensors and .bin; ``--weights bin`` for the other), its config and tokenizer files, and
skips ``original/``; ``--format meta`` fetches ``original/``'s consolidated.*.pth, params.json
and tokenizer.model instead. ``--allow-patterns``/``--ignore-patterns`` replace that choice.

Files go to the hub cache (``HF_HOME``, default ~/.cache/huggingface) or ``--output-dir``; what
is there already is not fetched again, so rerunning after an interruption fetches only what is missing. The token
comes from ``--hf-token``, ``HF_TOKEN`` or ``hf auth login`` (prefer the last two: a command
line is visible to other users of the machine) and is never printed. ``HF_HUB_OFFLINE=1`` serves
from the cache only. The repository id and commit are recorded in ``waypoint_source.json`` next
to the files.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Not the scripts' own folder on the path (scripts/inspect.py would shadow the standard library's inspect);
# a checkout that is not installed puts its root there instead, for the `waypoint` package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
if importlib.util.find_spec("waypoint") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from waypoint.errors import CheckpointError  # noqa: E402
from waypoint.cli.command import OneLineParser  # noqa: E402
from waypoint.cli.hub import (FORMATS, REPO_TYPES, WEIGHT_CHOICES, Snapshot, download, is_hf_uri,  # noqa: E402
                                   parse_hf_uri, choose_data_file)


class _Parser(OneLineParser):
    """argparse echoes unrecognised arguments in its errors: never a token among them."""

    secrets: tuple[str, ...] = ()

    def error(self, message: str):
        for secret in self.secrets:
            message = message.replace(secret, "***")
        message = re.sub(r"\bhf_[A-Za-z0-9]{8,}", "hf_***", message)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(description=__doc__.splitlines()[0],
                     epilog="Example: python scripts/download.py meta-llama/Llama-2-7b-hf && "
                            "python recipes/full_finetune.py --config configs/llama2_7b.yaml "
                            "checkpointer.checkpoint_dir=hf://meta-llama/Llama-2-7b-hf")
    parser.add_argument("repo_id", metavar="REPO_ID", help="org/name (or hf://org/name[@rev], hf://datasets/org/name)")
    parser.add_argument("--output-dir", help="put the files here instead of the hub cache")
    parser.add_argument("--revision", help="branch, tag or commit sha (default: the default branch)")
    parser.add_argument("--hf-token", help="hub token (default: HF_TOKEN, then the stored login)")
    parser.add_argument("--allow-patterns", nargs="+", metavar="GLOB", help="fetch only matching paths (replaces the default choice)")
    parser.add_argument("--ignore-patterns", nargs="+", metavar="GLOB", help="skip matching paths (replaces the default choice)")
    parser.add_argument("--repo-type", choices=REPO_TYPES, default=None, help="model (default) or dataset")
    parser.add_argument("--format", dest="fmt", choices=FORMATS, default="hf",
                        help="hf: the HF-format files (default); meta: original/ (consolidated.*.pth, params.json, tokenizer.model)")
    parser.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                        help="which copy of the weights when the repository has both (default: safetensors)")
    return parser


def next_command(snap: Snapshot, fmt: str) -> str:
    """The command that fine-tunes on what was downloaded."""
    path = shlex.quote(str(snap.path))
    if snap.repo_type == "dataset":
        if snap.path.is_dir():  # the whole repository: point at its data file when there is one to pick
            prefix = "" if snap.path == snap.root else snap.path.relative_to(snap.root).as_posix() + "/"
            try:
                name = choose_data_file([f[len(prefix):] for f in snap.files if f.startswith(prefix)], snap.repo_id)
                path = shlex.quote(str(snap.path / name))
            except CheckpointError:
                path = shlex.quote(str(snap.path)) + "/<data file>"
        return f"python recipes/full_finetune.py --config configs/{_config_for(snap.repo_id)}.yaml dataset.source={path}"
    group = "checkpointer=meta " if fmt == "meta" else ""
    return f"python recipes/full_finetune.py --config configs/{_config_for(snap.repo_id)}.yaml {group}checkpointer.checkpoint_dir={path}"


def _config_for(repo_id: str) -> str:
    """A config in configs/ that mentions the repository's name (llama2_7b.yaml for Llama-2-7b-hf), else a placeholder."""
    name = repo_id.split("/")[-1].lower()
    for config in sorted((ROOT / "configs").glob("*.yaml")):
        try:
            if name in config.read_text().lower():
                return config.stem
        except OSError:
            continue
    return "YOUR_CONFIG"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    secrets = []
    for i, arg in enumerate(argv):  # --hf-token T, --hf-token=T and argparse's abbreviations (--hf T)
        if arg.startswith("--hf") and "=" in arg:
            secrets.append(arg.split("=", 1)[1])
        elif arg.startswith("--hf") and i + 1 < len(argv):
            secrets.append(argv[i + 1])
    parser.secrets = tuple(s for s in secrets if s)
    args = parser.parse_args(argv)

    repo_id, repo_type, revision, subpath = args.repo_id, args.repo_type or "model", args.revision, None
    if is_hf_uri(repo_id):
        try:
            ref = parse_hf_uri(repo_id)
        except CheckpointError as e:
            parser.error(str(e))
        repo_id, subpath = ref.repo_id, ref.path
        repo_type = args.repo_type or ref.repo_type
        revision = revision or ref.revision
    try:
        if args.output_dir:  # a URL is refused, never made into a folder named "s3:" (imported here: it imports torch)
            from waypoint.run.output_dir import local_output
            local_output(args.output_dir, "--output-dir")
        snap = download(repo_id, repo_type=repo_type, revision=revision, fmt=args.fmt, weights=args.weights,
                        allow_patterns=args.allow_patterns, ignore_patterns=args.ignore_patterns, subpath=subpath,
                        local_dir=args.output_dir, token=args.hf_token or None)
    except CheckpointError as e:
        if os.environ.get("WAYPOINT_DEBUG"):
            raise
        print(f"\nerror: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1

    fetched = (f"{len(snap.fetched)} files fetched ({snap.fetched_bytes / 1e9:.2f} GB)" if snap.fetched
               else "nothing to fetch")
    present = len(snap.files) - len(snap.fetched)
    print(f"{snap.repo_id} at commit {snap.revision}: {len(snap.files)} files, {fetched}"
          + (f", {present} already present" if present and snap.fetched else ""))
    print(f"files: {snap.path}")
    print(f"next: {next_command(snap, args.fmt)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
