"""Shared fixtures: small prepared datasets in temporary folders (the repository's data/ is never touched)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, 'data', 'shakespeare_char'))
SHAKESPEARE = os.path.join(ROOT, '..', 'shared', 'data', 'tinyshakespeare.txt')

import prepare as char_prepare  # noqa: E402  data/shakespeare_char/prepare.py


@pytest.fixture(scope='session')
def small_data(tmp_path_factory):
    """A char dataset from a ~20 KB text written here: enough for smoke tests, independent of any download."""
    folder = tmp_path_factory.mktemp('small_data')
    lines = ["First Citizen:\nBefore we proceed any further, hear me speak.\n",
             "All:\nSpeak, speak.\n", "ROMEO:\nBut, soft! what light through yonder window breaks?\n"]
    text = ''.join(lines[i % 3] for i in range(300))
    char_prepare.prepare(text, str(folder))
    return str(folder)


@pytest.fixture(scope='session')
def shakespeare_data(tmp_path_factory):
    """The real tiny Shakespeare, char level, from ../shared/data when it is there."""
    if not os.path.exists(SHAKESPEARE):
        pytest.skip(f"{SHAKESPEARE} not found; the science tests need the real corpus")
    folder = tmp_path_factory.mktemp('shakespeare_char')
    char_prepare.prepare(char_prepare.get_text(SHAKESPEARE), str(folder))
    return str(folder)
