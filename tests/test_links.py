"""Every relative link in the README and docs/ reaches a file that exists and, for a link into a markdown page with
an #anchor, a heading of that page (GitHub's anchors: lowercase, punctuation dropped, spaces to hyphens)."""

import glob
import os
import re

import pytest

from conftest import ROOT

PAGES = ['README.md', *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md'))),
         'assignments/README.md']


def anchors(path):
    with open(path, encoding='utf-8') as f:
        text = re.sub(r'```.*?```', '', f.read(), flags=re.S)  # a '#' line in a code block is no heading
    return {re.sub(r'[^\w\- ]', '', h.strip().lower()).replace(' ', '-')
            for h in re.findall(r'^#{1,6} (.+)$', text, flags=re.M)}


@pytest.mark.parametrize('page', PAGES)
def test_every_relative_link_reaches_its_file_and_heading(page):
    with open(os.path.join(ROOT, page), encoding='utf-8') as f:
        text = f.read()
    broken = []
    for target in re.findall(r'\]\(([^)\s]+)\)', text):
        if re.match(r'[a-z]+:', target):  # https:, mailto: ...
            continue
        path, _, anchor = target.partition('#')
        full = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
        if not os.path.exists(full):
            broken.append(f"{target}: no such file")
        elif anchor and full.endswith('.md') and anchor not in anchors(full):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{page}: " + '; '.join(broken)
