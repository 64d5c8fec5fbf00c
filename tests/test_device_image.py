"""The GPU check imports on the device image: every third-party module that ``app.main``, its
gRPC front end (imported when ``GRPC_PORT`` is set) and ``benchmarks.gpu_check`` import when
they load (following this project's own modules, and
leaving out imports inside functions and ``try: ... except ImportError``) comes from a package
the image has or from the wheels ``benchmarks.gpu_wheels`` carries to it."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

from benchmarks.gpu_wheels import DEVICE_IMAGE, PACKAGES

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = ["app.main", "app.grpc.server", "benchmarks.gpu_check"]
FIRST_PARTY = {"app", "preprocessing", "batching", "benchmarks", "harness", "tests"}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imports_at_load(tree: ast.Module, module: str, package: bool) -> set[str]:
    """Modules ``tree`` imports when it loads (not in functions, not guarded by ImportError)."""
    found: set[str] = set()

    def guarded(handlers: list[ast.ExceptHandler]) -> bool:
        names = {ast.unparse(h.type) for h in handlers if h.type is not None}
        return bool(names & {"ImportError", "ModuleNotFoundError", "(ImportError, OSError)"})

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if package else module.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module or ""
                found.add(stem)
                found.update(f"{stem}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in ast.unparse(node.test):
                    visit(node.body)
                    visit(node.orelse)
            elif isinstance(node, ast.Try):
                if not guarded(node.handlers):
                    visit(node.body)
            elif isinstance(node, (ast.ClassDef, ast.With)):
                visit(node.body)

    visit(tree.body)
    return found


def third_party_at_load(entries: list[str]) -> dict[str, str]:
    """Each third-party top-level module imported when ``entries`` load, and one importer."""
    seen: set[str] = set()
    outside: dict[str, str] = {}
    queue = list(entries)
    while queue:
        module = queue.pop()
        if module in seen:
            continue
        seen.add(module)
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        package = spec.submodule_search_locations is not None
        tree = ast.parse(Path(spec.origin).read_text())
        for name in _imports_at_load(tree, module, package):
            top = name.split(".")[0]
            if top in FIRST_PARTY:
                # ``from pkg import name`` may name a module or an attribute: follow modules.
                try:
                    if importlib.util.find_spec(name) is not None:
                        queue.append(name)
                except (ImportError, ValueError):
                    pass
            elif top and top not in sys.stdlib_module_names and top != "__future__":
                outside.setdefault(top, module)
    return outside


def test_the_gpu_check_imports_only_what_the_device_image_and_the_wheels_hold() -> None:
    carried = {_normal(name) for name in (*DEVICE_IMAGE, *PACKAGES)}
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for top, importer in third_party_at_load(ENTRIES).items():
        names = {_normal(name) for name in distributions.get(top, [top])}
        if not names & carried:
            missing[top] = f"{sorted(names)} (imported by {importer})"
    assert not missing, f"not on the device image nor in gpu_wheels.PACKAGES: {missing}"


def test_the_walk_sees_through_this_projects_modules() -> None:
    """The check would fail if the walk missed what the serving core imports."""
    assert {"torch", "fastapi", "simplejpeg"} <= set(third_party_at_load(["app.main"]))
    # gRPC only when its front end is asked for: app.main imports it inside the lifespan.
    assert "grpc" not in third_party_at_load(["app.main"])
    assert {"grpc", "grpc_health", "tritonclient"} <= set(third_party_at_load(["app.grpc.server"]))


# Run in a process of its own: every import of a third-party module outside the device image
# and the wheels fails there, as it would on the device, including those made while serving.
_ONLY_THE_DEVICE_IMAGE = r"""
import asyncio, importlib.abc, importlib.metadata, re, sys

from benchmarks.gpu_wheels import DEVICE_IMAGE, PACKAGES

normal = lambda name: re.sub(r"[-_.]+", "-", name).lower()
allowed = {normal(name) for name in (*DEVICE_IMAGE, *PACKAGES)}
distributions = importlib.metadata.packages_distributions()
first_party = {"app", "preprocessing", "batching", "benchmarks", "harness", "tests"}
refused = set()

class DeviceImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if (top in sys.stdlib_module_names or top in first_party or top.startswith("_")
                or top not in distributions):
            return None
        if not {normal(d) for d in distributions[top]} & allowed:
            refused.add(top)
            raise ModuleNotFoundError(f"not on the device image: {top}", name=name)
        return None

sys.meta_path.insert(0, DeviceImage())
import benchmarks.gpu_check  # noqa
import httpx
from asgi_lifespan import LifespanManager
from app.main import create_app
from tests.conftest import make_settings
from tests import images

async def main():
    app = create_app(make_settings(grpc_port=GRPC_PORT))
    async with LifespanManager(app, startup_timeout=120) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://device") as client:
            answer = await client.post("/predict", content=images.jpeg(images.solid((200, 0, 0))),
                                       headers={"content-type": "image/jpeg"})
            assert answer.status_code == 200, answer.text
    print("refused:", sorted(refused))

asyncio.run(main())
"""


def test_the_server_starts_and_answers_with_only_the_device_images_packages() -> None:
    """Imports made while starting and serving (with gRPC on) count too, not only those at
    load: each one outside the two lists fails in that process."""
    import subprocess

    from harness.servers import free_port

    script = _ONLY_THE_DEVICE_IMAGE.replace("GRPC_PORT", str(free_port()))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout
