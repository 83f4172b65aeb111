import pytest
from webtext.slug import slugify


@pytest.mark.parametrize("title, want", [
    ("  Many   spaces  ", "many-spaces"), ("--a--b--", "a-b"), ("already-a-slug", "already-a-slug"),
    ("", ""), ("Ver 2.0 Release", "ver-2-0-release"), ("!!!", ""), ("C'est la vie", "c-est-la-vie"),
])
def test_slugify(title, want):
    assert slugify(title) == want
