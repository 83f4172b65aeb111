from webtext.slug import slugify


def test_punctuation_and_spaces():
    assert slugify("Hello, World!") == "hello-world"


def test_a_plain_title():
    assert slugify("release") == "release"
