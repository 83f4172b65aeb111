from contacts.extract import all_emails, first_email


def test_no_address():
    assert first_email("nothing here @ all") is None


def test_address_at_the_start():
    assert first_email("bo.b+x@mail.example.org wrote") == "bo.b+x@mail.example.org"


def test_the_first_of_several():
    text = "cc: c@d.io, then a@b.com and e@f.net"
    assert first_email(text) == "c@d.io"
    assert all_emails(text) == ["c@d.io", "a@b.com", "e@f.net"]
