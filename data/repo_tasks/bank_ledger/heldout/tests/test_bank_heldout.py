import pytest
from bank.account import Account
from bank.ledger import Ledger


def test_histories_over_many_operations():
    accounts = [Account(str(i), 100) for i in range(3)]
    for i, acc in enumerate(accounts):
        for k in range(i + 1):
            acc.deposit(k + 1)
        acc.withdraw(1)
    assert [len(a.history) for a in accounts] == [2, 3, 4]
    assert accounts[2].history[-1] == ("withdraw", 1)


def test_total_follows_new_accounts_and_withdrawals():
    ledger = Ledger()
    ledger.open("a", 1)
    assert ledger.total() == 1
    b = ledger.open("b", 20)
    assert ledger.total() == 21
    b.withdraw(5)
    assert ledger.total() == 16


def test_overdraw_changes_nothing():
    acc = Account("z", 3)
    with pytest.raises(ValueError):
        acc.withdraw(4)
    assert acc.balance == 3 and acc.history == []
