"""Tag lists."""


def add_tag(tag, tags=[]):
    """`tags` with `tag` appended once. A list passed in is extended in place and returned;
    without one, a new list is returned."""
    if tag not in tags:
        tags.append(tag)
    return tags


class Note:
    """A note and its tags; every note starts tagged 'note'."""

    def __init__(self, text):
        self.text = text
        self.tags = add_tag("note")

    def tag(self, tag):
        add_tag(tag, self.tags)
