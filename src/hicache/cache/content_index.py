"""Finding a prompt's unchanged spans after an edit (issue 61): a content index over the cached
pages of the request's namespaces, looked up at every position of the prompt past its cached prefix.

Prefix matching stops at the first changed token. Past it, an insertion, a deletion, a changed
line or a reordering leaves the rest of the prompt equal to cached pages at *other* positions:
each whole cached page is indexed by its tokens alone (not by its chained prefix hash), and a
window of the prompt that equals one is extended along the cached sequence that page belongs to
(the next page of its node, then the child that continues with the prompt's next page), as long
as the tokens agree page by page. A prompt's span is whole cached pages long but may start at any
position: the KV it reuses is re-rotated to its new positions by the caller.

Only the request's namespaces are searched (its exact one and its :func:`edit_namespace`: a
``cache_salt`` never reads another's pages), in both tiers that hold KV in memory: a node's device
pages (L1), else its host pages (L2); storage (L3) objects are not searched. Never a page being
written (:class:`Unreadable`). The search is a pure function of the tree and the prompt: the same
on every rank that holds the same tree. Its cost is the index's build, linear in the namespace's
cached pages (~25 ms for 15,000 pages of 16 tokens on a 2-core AVX2 VM, and ~5 ms more per 20,000
prompt tokens looked up); a tail shorter than one span skips it.

Units: positions and lengths are tokens; pages are device or host page ids (``ReusedSpan.host``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .page_tree import PageTree
from .tree_node import TreeNode


EDIT_PREFIX = "edit-reuse:"  # (a tree namespace starts with hex digits: no exact one starts with this)


def edit_namespace(namespace: str) -> str:
    """Where the approximate KV of ``namespace``'s edited prompts is cached: a namespace of its own,
    never hit by a request without edit reuse; its storage keys chain from its own name."""
    return namespace if namespace.startswith(EDIT_PREFIX) else EDIT_PREFIX + namespace


def exact_namespace(namespace: str) -> str:
    """The exact namespace ``namespace`` (exact, or an :func:`edit_namespace`) belongs to."""
    return namespace[len(EDIT_PREFIX):] if namespace.startswith(EDIT_PREFIX) else namespace


@dataclass(frozen=True)
class ReusedSpan:
    """``length`` tokens of the prompt from position ``dst`` equal the cached sequence's tokens
    from position ``src``, whose KV lives in ``pages`` (``length / page_size`` of them): device
    pages, or host pages where ``host`` says so (a page a node holds on the device is read there)."""

    dst: int
    src: int
    length: int
    pages: np.ndarray
    host: np.ndarray  # bool, one per page

    @property
    def shift(self) -> int:
        """Positions the span moved (its keys are re-rotated by this many)."""
        return self.dst - self.src


@dataclass(frozen=True)
class Unreadable:
    """Pages being written: device pages a host load is filling, host pages a backup is filling."""

    device: frozenset[int] = frozenset()
    host: frozenset[int] = frozenset()


@dataclass(frozen=True)
class PageRef:
    """Page ``page`` of ``node``, at position ``position`` of its cached sequence."""

    node: TreeNode
    page: int
    position: int


def cached_nodes(tree: PageTree, namespace: str) -> Iterator[tuple[TreeNode, int]]:
    """Every node of ``namespace`` with device or host pages, and the position its key starts at,
    in a fixed order (depth first, children in insertion order)."""
    root = next((r for r in tree.roots() if r.namespace == namespace), None)
    stack = [] if root is None else [(root, 0)]
    while stack:
        node, start = stack.pop()
        if not node.is_root and (node.device_pages is not None or node.host_pages is not None):
            yield node, start
        stack.extend((child, start + len(node.key)) for child in reversed(list(node.children.values())))


def source(node: TreeNode, i: int, unreadable: Unreadable) -> tuple[int, bool] | None:
    """Where page ``i`` of ``node`` can be read: (page, on the host), or None."""
    if node.device_pages is not None:
        page = int(node.device_pages[i])
        return None if page in unreadable.device else (page, False)
    if node.host_pages is not None:
        page = int(node.host_pages[i])
        return None if page in unreadable.host else (page, True)
    return None


def index_pages(tree: PageTree, namespaces: Sequence[str], unreadable: Unreadable = Unreadable()) -> dict[bytes, PageRef]:
    """Each readable cached page's tokens -> where it is cached (the first such page of the first
    namespace, in :func:`cached_nodes`' order)."""
    size, index = tree.page_size, {}
    for namespace in namespaces:
        for node, start in cached_nodes(tree, namespace):
            for i in range(len(node.key) // size):
                if source(node, i, unreadable) is not None:
                    index.setdefault(node.key[i * size : (i + 1) * size].tobytes(), PageRef(node, i, start + i * size))
    return index


def extend(tree: PageTree, ref: PageRef, tokens: np.ndarray, at: int, end: int,
           unreadable: Unreadable = Unreadable()) -> list[tuple[int, bool]]:
    """The pages (page, on the host) of the cached sequence from ``ref`` on that equal
    ``tokens[at:end]``, page by page, as far as they agree and can be read (following the child
    that continues with the prompt's next page)."""
    size, node, i, pages = tree.page_size, ref.node, ref.page, []
    while at + size <= end:
        window = tokens[at : at + size]
        if i == len(node.key) // size:
            child = node.children.get(window.tobytes())
            if child is None:
                break
            node, i = child, 0
        where = source(node, i, unreadable)
        if where is None or not np.array_equal(node.key[i * size : (i + 1) * size], window):
            break
        pages.append(where)
        at, i = at + size, i + 1
    return pages


def find_spans(tree: PageTree, namespaces: Sequence[str], tokens: np.ndarray, start: int, end: int, min_tokens: int,
               unreadable: Unreadable = Unreadable()) -> list[ReusedSpan]:
    """The spans of ``tokens[start:end]`` (int32) found in the cache of ``namespaces`` (the first
    one's pages first), left to right, none shorter than ``min_tokens``: at each position the window
    of one page is looked up, and a hit is extended as far as the cached sequence agrees; the search
    goes on after the span."""
    size = tree.page_size
    if end - start < max(min_tokens, size):
        return []  # (no span fits: the index is not built)
    tokens = np.ascontiguousarray(tokens, dtype=np.int32)
    index = index_pages(tree, namespaces, unreadable)
    spans, at = [], start
    while at + size <= end and index:
        ref = index.get(tokens[at : at + size].tobytes())
        pages = extend(tree, ref, tokens, at, end, unreadable) if ref is not None else []
        if len(pages) * size >= max(min_tokens, size):
            ids, host = zip(*pages)
            spans.append(ReusedSpan(at, ref.position, len(pages) * size, np.asarray(ids, dtype=np.int64),
                                    np.asarray(host, dtype=bool)))
            at += len(pages) * size
        else:
            at += 1
    return spans
