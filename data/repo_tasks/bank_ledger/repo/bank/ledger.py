"""All accounts of the bank."""
from bank.account import Account


class Ledger:
    """Accounts by owner, and the bank's total balance."""

    def __init__(self):
        self.accounts = {}
        self._total = None

    def open(self, owner, balance=0):
        account = Account(owner, balance)
        self.accounts[owner] = account
        return account

    def total(self):
        """The sum of every account's balance, now."""
        if self._total is None:
            self._total = sum(a.balance for a in self.accounts.values())
        return self._total
