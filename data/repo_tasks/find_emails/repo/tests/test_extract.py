from contacts.extract import first_email


def test_address_in_the_middle():
    assert first_email("write to ann@example.com today") == "ann@example.com"
