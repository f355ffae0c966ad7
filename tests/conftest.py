"""Shared fixtures: small prepared datasets in temporary folders (the repository's data/ is never touched); child
processes run side by side."""

import os
import subprocess

import pytest

from data.shakespeare_char import prepare as char_prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_together(*children, timeout=300):
    """[(returncode, stdout, stderr)] of child processes, each given as subprocess.Popen's keyword arguments, all
    started before any is waited for: tests whose children spend their time importing torch and running
    single-threaded code take about half as long on two cores this way as one after another."""
    started = [subprocess.Popen(**kw, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for kw in children]
    outs = [child.communicate(timeout=timeout) for child in started]
    return [(child.returncode, out, err) for child, (out, err) in zip(started, outs)]


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
    """The real tiny Shakespeare (the text that ships in data/shakespeare_char), char level, prepared in a
    temporary folder. Never skipped: a missing or damaged text fails the tests that need it."""
    folder = tmp_path_factory.mktemp('shakespeare_char')
    char_prepare.prepare(char_prepare.get_text(), str(folder))
    return str(folder)
