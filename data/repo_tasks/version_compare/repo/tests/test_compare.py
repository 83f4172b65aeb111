from versions.compare import compare


def test_older_minor_version():
    assert compare("1.2", "1.10") == -1


def test_newer_major_version():
    assert compare("2.0", "1.9") == 1
