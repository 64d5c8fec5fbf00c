"""Two configurations of the server side by side, in alternating slices seconds apart.

For a change of a few per cent, fresh processes one after the other cannot tell it from the
machine's drift. Here both servers (A: ``--set``; B: the same with ``--b`` settings,
``--b-env`` environment variables and, with ``--b-access-log``, uvicorn's access log on) stay
up, and wrk loads one at a time (an idle server takes no CPU): A then B, then B then A, ... in
slices counted in their middle from each server's own metrics (``benchmarks.served_vs_limit``'s
counting). Each pair gives its own ratio B / A; the report is their median, range, and how many
pairs B won.

With ``--a-revision REV``, A is served from a worktree of that revision, B from this checkout
with the same settings: a change of the code measured against the code before it.

Usage: ``python -m benchmarks.served_ab --model resnet18 --set backend=openvino
--b max_inflight_batches=1``
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import wrk
from benchmarks.commits import git
from benchmarks.common import machine, machine_markdown, median, model_arguments, publish, table
from benchmarks.compare import server_env
from benchmarks.corpus import corpus
from benchmarks.served_vs_limit import SETTLE_S, served_per_second, settings_of
from harness.servers import ROOT, UvicornProcess


@contextlib.contextmanager
def checkout(revision: str | None) -> Iterator[Path]:
    """This checkout, or a worktree of ``revision`` for as long as the block runs."""
    if revision is None:
        yield ROOT
        return
    with tempfile.TemporaryDirectory() as folder:
        tree = Path(folder) / "a"
        git("worktree", "add", "--detach", str(tree), revision)
        try:
            yield tree
        finally:
            git("worktree", "remove", "--force", str(tree))


def summary(pairs: list[dict[str, float]]) -> dict[str, float]:
    """Each pair's own ratio B / A, then their median and range, and the pairs B won."""
    ratios = [pair["b"] / pair["a"] for pair in pairs]
    return {"median_ratio": median(ratios), "min_ratio": min(ratios),
            "max_ratio": max(ratios), "b_won": sum(ratio > 1 for ratio in ratios)}  # fmt: skip


def measure(args: argparse.Namespace) -> list[dict[str, float]]:
    a_env = {**server_env(args.model, args.precision, args.batch_size), **settings_of(args.set)}
    b_env = {**a_env, **settings_of(args.b),
             **dict(item.split("=", 1) for item in args.b_env)}  # fmt: skip
    images = corpus(None, 64)
    seconds = args.seconds + 2 * SETTLE_S
    pairs = []
    with (
        checkout(args.a_revision) as a_root,
        UvicornProcess(a_env, startup_timeout=600, root=a_root) as a,
        UvicornProcess(b_env, startup_timeout=600, access_log=args.b_access_log) as b,
        wrk.command_for(a.url, images, args.clients) as load_a,
        wrk.command_for(b.url, images, args.clients) as load_b,
    ):
        servers = {"a": (a.url, load_a), "b": (b.url, load_b)}
        for url, load in servers.values():
            served_per_second(url, load(seconds), 1.0)  # warm-up
        for index in range(args.pairs):
            pair = {}
            for name in ("a", "b") if index % 2 == 0 else ("b", "a"):
                url, load = servers[name]
                pair[name] = served_per_second(url, load(seconds), args.seconds)
            pairs.append(pair)
            print(f"  pair {index + 1}: A {pair['a']:.1f}, B {pair['b']:.1f} images/s, "
                  f"B / A {pair['b'] / pair['a']:.3f}", flush=True)  # fmt: skip
    return pairs


def markdown(data: dict[str, Any]) -> str:
    rows = [[index + 1, pair["a"], pair["b"], pair["b"] / pair["a"]]
            for index, pair in enumerate(data["pairs"])]  # fmt: skip
    result = data["summary"]
    a = " ".join(data["set"]) or "defaults"
    access_log = data.get("b_access_log", False)
    logged = ["uvicorn's access log on"] if access_log else []
    revision = data.get("a_revision")
    if revision:
        a = f"{a} at {revision}"
    b = " ".join([*data["b"], *data["b_env"], *logged]) or "this checkout"
    options = "".join(f" --{flag} {' '.join(data[key])}"
                      for flag, key in (("set", "set"), ("b", "b"), ("b-env", "b_env"))
                      if data[key])  # fmt: skip
    options += " --b-access-log" if access_log else ""
    options += f" --a-revision {revision}" if revision else ""
    return f"""# Two server configurations side by side: {data["model"]}

`python -m benchmarks.served_ab --model {data["model"]} --precision {data["precision"]}
{options.strip()}`: batch
{data["batch_size"]}, wrk at {data["clients"]} clients on the same machine, both servers up and
loaded one at a time, {len(data["pairs"])} pairs of alternating {data["seconds"]} s slices each
counted in its middle. A: {a}; B: A with {b}.

B / A: **{result["median_ratio"]:.3f}** (the median of the pairs' own ratios; pairs
{result["min_ratio"]:.3f} to {result["max_ratio"]:.3f}; B faster in {result["b_won"]} of
{len(data["pairs"])}).

{table(["pair", "A img/s", "B img/s", "B / A"], rows)}

## Machine

{machine_markdown(data["machine"])}
"""


def main() -> None:
    parser = model_arguments(__doc__, __file__)
    parser.add_argument("--set", nargs="*", default=[], help="both servers' settings")
    parser.add_argument("--b", nargs="*", default=[], help="B's settings on top")
    parser.add_argument("--b-env", nargs="*", default=[], help="B's environment, NAME=value")
    parser.add_argument("--b-access-log", action="store_true",
                        help="B with uvicorn's access log on, as make serve runs it")  # fmt: skip
    parser.add_argument("--a-revision", help="serve A from a worktree of this revision")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0, help="counted per slice")
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--name", default="served-ab")
    args = parser.parse_args()
    wrk.require()
    pairs = measure(args)
    data = {"machine": machine(), "model": args.model, "precision": args.precision,
            "batch_size": args.batch_size, "clients": args.clients, "set": args.set,
            "b": args.b, "b_env": args.b_env, "b_access_log": args.b_access_log,
            "a_revision": git("rev-parse", "--short", args.a_revision) if args.a_revision else None,
            "seconds": args.seconds, "pairs": pairs,
            "summary": summary(pairs)}  # fmt: skip
    publish(args.name, data, markdown(data))


if __name__ == "__main__":
    main()
