"""Shared fixtures: small prepared datasets in temporary folders (the repository's data/ is never touched)."""

import os

import pytest

from data.shakespeare_char import prepare as char_prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_corpus():
    """The real tiny Shakespeare text, where a user has it: the file named by $LOOPED_CORPUS, or the copy
    data/shakespeare_char/input.txt that the prepare script downloads on first use. None when neither exists."""
    for path in (os.environ.get('LOOPED_CORPUS'), os.path.join(ROOT, 'data', 'shakespeare_char', 'input.txt')):
        if path and os.path.isfile(path):
            return path
    return None


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
    """The real tiny Shakespeare, char level, prepared in a temporary folder."""
    corpus = find_corpus()
    if corpus is None:
        pytest.skip("the science tests need the real tiny Shakespeare text: run python -m data.shakespeare_char.prepare "
                    "once (it downloads data/shakespeare_char/input.txt), or set LOOPED_CORPUS to a local copy")
    folder = tmp_path_factory.mktemp('shakespeare_char')
    char_prepare.prepare(char_prepare.get_text(corpus), str(folder))
    return str(folder)
