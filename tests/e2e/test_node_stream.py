"""docs/protocol.md's Node example of a streamed reply (contract 1.3), run as written.

The ``js`` block of "Streamed replies from Node" runs under ``node`` against a private
redis-server and a real ``inferfleet worker`` serving the example language model TinyLM on the
queue ``tokens``, with the prompt, queue, ``REDIS_URL`` and ``MAX_NEW_TOKENS`` in its
environment as the page says. What it prints must be the model's own greedy recomputation
(``TinyLM.reference_generate``, no cache): the text, then every token id and the final chunk's
``finish_reason``.

ioredis and @msgpack/msgpack come from npm, installed once into a cache folder outside the
repository (``$XDG_CACHE_HOME/inferfleet-node``, by default ``~/.cache/inferfleet-node``) and
reused by later runs; the block runs from a folder of its own that links to those packages.
Without node or npm the test fails under CI and is skipped elsewhere, saying so.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT, require_programs, running_in_ci
from tests.docs_blocks import FENCE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # npm's first install, a worker's start

PAGE = ROOT / "docs" / "protocol.md"
SECTION = "### Streamed replies from Node"
#: What the block imports, at the major versions it was written for.
PACKAGES = ("ioredis@6", "@msgpack/msgpack@3")
NAME = "tokens"
EOS = 256  # TinyLM's end token
#: (prompt, max_new_tokens): one stream that ends at the limit, one at the model's end token.
CASES = [("inferfleet ", 24), ("./scripts/", 8)]


def node_block() -> str:
    """The one ``js`` block of the page's "Streamed replies from Node" subsection."""
    text = PAGE.read_text()
    start = text.index(SECTION)
    section = text[start : text.index("\n## ", start)]
    (block,) = [body for lang, body in FENCE.findall(section) if lang == "js"]
    return block


def node_cache() -> Path:
    """Where the npm packages are kept between runs, outside the repository."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "inferfleet-node"


@pytest.fixture(scope="session")
def node_modules() -> Path:
    """The cache's ``node_modules`` with :data:`PACKAGES`, installed by npm unless a run before
    did (one install at a time: a lock file)."""
    require_programs("node", "npm", why="the Node example runs under node, its packages from npm")
    cache = node_cache()
    cache.mkdir(parents=True, exist_ok=True)
    marker = cache / "installed.json"
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        installed = marker.is_file() and json.loads(marker.read_text()) == list(PACKAGES)
        if not (installed and (cache / "node_modules").is_dir()):
            done = subprocess.run(
                ["npm", "install", "--prefix", str(cache), "--no-audit", "--no-fund"]
                + ["--loglevel=error", *PACKAGES],
                capture_output=True,
                text=True,
                timeout=240,
            )
            if done.returncode != 0:
                message = f"npm install {' '.join(PACKAGES)} failed:\n{done.stdout}{done.stderr}"
                if running_in_ci():
                    pytest.fail(message)
                pytest.skip(message)
            marker.write_text(json.dumps(list(PACKAGES)))
    return cache / "node_modules"


def greedy(model_path: Path) -> dict[tuple[str, int], list[int]]:
    """Each case's tokens as TinyLM recomputes them greedily, with no cache."""
    import torch

    from tests.fixtures.tiny_lm import TinyLM

    model = TinyLM(model_path)
    model.setup(torch.device("cpu"))
    return {
        (prompt, max_new): [
            int(t)
            for t in model.reference_generate(
                np.frombuffer(prompt.encode("utf-8"), np.uint8).astype(np.int64), max_new
            )
        ]
        for prompt, max_new in CASES
    }


def test_the_node_example_streams_the_models_greedy_tokens(
    tmp_path: Path, redis_url: str, spawn_worker, tinylm: Path, node_modules: Path
) -> None:
    from tests.fixtures.tiny_lm import decode

    script = tmp_path / "stream.mjs"  # an ES module: the block uses import and top-level await
    script.write_text(node_block())
    (tmp_path / "node_modules").symlink_to(node_modules, target_is_directory=True)
    expected = greedy(tinylm)
    spawn_worker(NAME, "tests.fixtures.tiny_lm:TinyLM")
    for prompt, max_new in CASES:
        env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "QUEUE": NAME,
            "PROMPT": prompt,
            "MAX_NEW_TOKENS": str(max_new),
        }
        done = subprocess.run(
            ["node", script.name],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"node exited {done.returncode}:\n{done.stdout}{done.stderr}"
        tokens = expected[(prompt, max_new)]
        # the text as it streamed (the end token is no text), then the ids and why it ended
        assert done.stdout.startswith(decode(tokens) + "\n"), done.stdout
        summary = r"^finish_reason: (\w+), (\d+) tokens: (\[[\d,]*\])$"
        found = re.search(summary, done.stdout, re.MULTILINE)
        assert found, done.stdout
        assert json.loads(found.group(3)) == tokens
        assert int(found.group(2)) == len(tokens)
        assert found.group(1) == ("stop" if tokens[-1] == EOS else "length")
        assert "name: 'tokens'" in done.stdout  # the final chunk's model, as node prints it
