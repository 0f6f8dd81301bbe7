"""Where the CPU's large tables live (csrc/cpu/simd/cache_lines.h): a table of 1 MB or more (the per-token t-cubic
table, 1.6 MB for the shipped KL table) gets a mapping of its own, whole 2 MB pages from a 2 MB boundary, advised for
transparent huge pages before its first touch, never a block of the heap that may already sit on 4 KB pages. Read
from /proc/self/smaps in a fresh process (the advice shows as the `hg` VmFlag); whether the kernel then gives a 2 MB
page depends on its memory, and is printed, not asserted."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import run_fresh

pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
                       reason="Linux transparent huge pages only"),
]

CHECK = r"""
import json, re, torch
import bandpo_lut

def advised():
    found, vma = {}, None
    for line in open("/proc/self/smaps"):
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \S+\s*(.*)$", line)
        if m:
            vma = (int(m[1], 16), int(m[2], 16), m[3].strip())
            continue
        if line.startswith("AnonHugePages:") and vma is not None:
            huge_kb = int(line.split()[1])
        if line.startswith("VmFlags:") and "hg" in line.split()[1:]:
            found[vma] = huge_kb
    return found

# large blocks allocated and freed first, as in a training process: glibc then serves mid-sized blocks from its heap
for _ in range(3):
    x = torch.empty(3 << 20, dtype=torch.uint8).fill_(1)
    del x
before = advised()
g = torch.Generator().manual_seed(0)
n = 1 << 22   # batch-sized tensors before it, as in training: with them glibc served the table from its heap
p = torch.rand(n, generator=g)
delta = torch.rand(n, generator=g) * 0.09 + 0.01
bandpo_lut.clip(torch.ones(n), p, delta)   # per-token δ, float32: builds the t-cubic table
new = {k: v for k, v in advised().items() if k not in before}
print(json.dumps([[s, e, name, kb] for (s, e, name), kb in new.items()]))
"""


def test_the_per_token_table_has_advised_2mb_pages_of_its_own(tmp_path):
    r = run_fresh(["-c", CHECK], cwd=tmp_path, timeout=300, check=True)
    new = json.loads(r.stdout.strip().splitlines()[-1])
    page = 2 << 20
    own = [(s, e, name, kb) for s, e, name, kb in new if name == "" and s % page == 0 and (e - s) == page]
    assert own, f"no anonymous 2 MB-aligned mapping of one 2 MB page advised for huge pages appeared: {new}"
    assert not any(name == "[heap]" for _, _, name, _ in new), f"a table advised inside the heap: {new}"
    print(f"advised mappings: {new} (AnonHugePages in kB last)")
