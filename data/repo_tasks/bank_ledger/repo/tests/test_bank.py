from bank.account import Account
from bank.ledger import Ledger


def test_histories_are_separate():
    a, b = Account("ann"), Account("bob")
    a.deposit(5)
    assert a.history == [("deposit", 5)] and b.history == []


def test_total_follows_deposits():
    ledger = Ledger()
    ann = ledger.open("ann", 10)
    assert ledger.total() == 10
    ann.deposit(5)
    assert ledger.total() == 15
