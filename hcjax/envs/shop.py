"""A stateful tool environment: a seeded SQLite shop (customers, products, orders) behind eight
tools; an episode is graded on the final database state, compared with the state that the
task's reference actions produce from the same seed (RECIPE §3, §6).  Must not import JAX."""

from __future__ import annotations

import dataclasses
import random
import sqlite3
from collections.abc import Mapping, Sequence
from typing import Any

from hcjax.envs.tools import Tool, ToolCall, ToolResult, ToolSet
from hcjax.rewards.types import Grade

_FIRST = ["Ada", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jun"]
_LAST = ["Moreau", "Okafor", "Silva", "Tanaka", "Novak", "Haddad", "Kowalski", "Reyes"]
_PRODUCTS = ["lamp", "kettle", "backpack", "headphones", "notebook", "umbrella", "mug", "chair"]

_SCHEMA = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT UNIQUE, email TEXT,
                        balance_cents INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT UNIQUE, price_cents INTEGER NOT NULL,
                       stock INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, customer_id INTEGER NOT NULL,
                     product_id INTEGER NOT NULL, quantity INTEGER NOT NULL, status TEXT NOT NULL);
"""


def make_database(seed: int, num_customers: int = 6) -> sqlite3.Connection:
    """An in-memory shop whose every row is fixed by `seed`."""
    if not 1 <= num_customers <= len(_FIRST) * len(_LAST):
        raise ValueError(f"num_customers={num_customers} is not in [1, {len(_FIRST) * len(_LAST)}]")
    rng = random.Random(seed)
    db = sqlite3.connect(":memory:")
    db.executescript(_SCHEMA)
    names = rng.sample([f"{f} {sur}" for f in _FIRST for sur in _LAST], num_customers)
    for i, name in enumerate(names, start=1):
        email = name.lower().replace(" ", ".") + "@example.com"
        db.execute("INSERT INTO customers VALUES (?, ?, ?, ?)",
                   (i, name, email, rng.randrange(2_000, 50_000)))
    for i, product in enumerate(_PRODUCTS, start=1):
        db.execute("INSERT INTO products VALUES (?, ?, ?, ?)",
                   (i, product, rng.randrange(300, 9_000), rng.randrange(0, 6)))
    for _ in range(num_customers):
        db.execute("INSERT INTO orders (customer_id, product_id, quantity, status) "
                   "VALUES (?, ?, ?, 'delivered')",
                   (rng.randrange(1, num_customers + 1), rng.randrange(1, len(_PRODUCTS) + 1),
                    rng.randrange(1, 3)))
    db.commit()
    return db


def dump(db: sqlite3.Connection) -> dict[str, list[tuple]]:
    """Every table's rows, sorted: the state the grader compares."""
    tables = [r[0] for r in db.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "ORDER BY name")]
    return {t: sorted(db.execute(f"SELECT * FROM {t}").fetchall()) for t in tables}


def _row(db, sql, args) -> dict | None:
    cur = db.execute(sql, args)
    row = cur.fetchone()
    return None if row is None else dict(zip([c[0] for c in cur.description], row))


def shop_tools(db: sqlite3.Connection) -> ToolSet:
    """The eight tools, all acting on `db`."""

    def find_customer(name: str) -> ToolResult:
        row = _row(db, "SELECT * FROM customers WHERE lower(name) = lower(?)", (name,))
        return ToolResult(str(row)) if row else ToolResult(f"no customer named {name!r}", ok=False)

    def get_customer(customer_id: int) -> ToolResult:
        row = _row(db, "SELECT * FROM customers WHERE id = ?", (customer_id,))
        return ToolResult(str(row)) if row else ToolResult(f"no customer {customer_id}", ok=False)

    def list_products() -> ToolResult:
        rows = db.execute("SELECT id, name, price_cents, stock FROM products ORDER BY id")
        return ToolResult("\n".join(str(r) for r in rows))

    def get_product(name: str) -> ToolResult:
        row = _row(db, "SELECT * FROM products WHERE lower(name) = lower(?)", (name,))
        return ToolResult(str(row)) if row else ToolResult(f"no product named {name!r}", ok=False)

    def list_orders(customer_id: int) -> ToolResult:
        rows = db.execute("SELECT * FROM orders WHERE customer_id = ? ORDER BY id",
                          (customer_id,)).fetchall()
        return ToolResult("\n".join(str(r) for r in rows) or "no orders")

    def place_order(customer_id: int, product_id: int, quantity: int) -> ToolResult:
        customer = _row(db, "SELECT * FROM customers WHERE id = ?", (customer_id,))
        product = _row(db, "SELECT * FROM products WHERE id = ?", (product_id,))
        if customer is None or product is None:
            return ToolResult("error: unknown customer or product", ok=False)
        if quantity <= 0:
            return ToolResult(f"error: quantity={quantity} is not positive", ok=False)
        cost = product["price_cents"] * quantity
        if product["stock"] < quantity:
            return ToolResult(f"error: only {product['stock']} {product['name']} in stock",
                              ok=False)
        if customer["balance_cents"] < cost:
            return ToolResult(f"error: balance {customer['balance_cents']} < cost {cost}",
                              ok=False)
        with db:
            db.execute("UPDATE customers SET balance_cents = balance_cents - ? WHERE id = ?",
                       (cost, customer_id))
            db.execute("UPDATE products SET stock = stock - ? WHERE id = ?",
                       (quantity, product_id))
            cur = db.execute("INSERT INTO orders (customer_id, product_id, quantity, status) "
                             "VALUES (?, ?, ?, 'placed')", (customer_id, product_id, quantity))
        return ToolResult(f"order {cur.lastrowid} placed, charged {cost} cents")

    def cancel_order(order_id: int) -> ToolResult:
        order = _row(db, "SELECT * FROM orders WHERE id = ?", (order_id,))
        if order is None or order["status"] != "placed":
            return ToolResult(f"error: order {order_id} is not a placed order", ok=False)
        price = _row(db, "SELECT price_cents FROM products WHERE id = ?",
                     (order["product_id"],))["price_cents"]
        with db:
            db.execute("UPDATE orders SET status = 'cancelled' WHERE id = ?", (order_id,))
            db.execute("UPDATE customers SET balance_cents = balance_cents + ? WHERE id = ?",
                       (price * order["quantity"], order["customer_id"]))
            db.execute("UPDATE products SET stock = stock + ? WHERE id = ?",
                       (order["quantity"], order["product_id"]))
        return ToolResult(f"order {order_id} cancelled and refunded")

    def update_email(customer_id: int, email: str) -> ToolResult:
        if "@" not in email:
            return ToolResult(f"error: email={email!r} has no @", ok=False)
        with db:
            cur = db.execute("UPDATE customers SET email = ? WHERE id = ?", (email, customer_id))
        if cur.rowcount == 0:
            return ToolResult(f"error: no customer {customer_id}", ok=False)
        return ToolResult(f"email of customer {customer_id} set to {email}")

    return ToolSet([
        Tool("find_customer", "look up a customer by full name", {"name": str}, find_customer),
        Tool("get_customer", "a customer's record by id", {"customer_id": int}, get_customer),
        Tool("list_products", "all products with price and stock", {}, list_products),
        Tool("get_product", "a product's record by name", {"name": str}, get_product),
        Tool("list_orders", "a customer's orders", {"customer_id": int}, list_orders),
        Tool("place_order", "order a quantity of a product for a customer (pays, reserves stock)",
             {"customer_id": int, "product_id": int, "quantity": int}, place_order),
        Tool("cancel_order", "cancel a placed order (refund, restock)", {"order_id": int},
             cancel_order),
        Tool("update_email", "change a customer's email", {"customer_id": int, "email": str},
             update_email),
    ])


@dataclasses.dataclass(frozen=True)
class ShopTask:
    """`instruction` for the agent; `reference` = the (tool, arguments) calls that solve it."""

    seed: int
    instruction: str
    reference: Sequence[tuple[str, Mapping[str, Any]]]


def make_task(seed: int) -> ShopTask:
    """A random task (order, cancel or email change) whose reference solution succeeds."""
    rng = random.Random(seed)
    db = make_database(seed)
    customers = db.execute("SELECT id, name, balance_cents FROM customers").fetchall()
    products = db.execute("SELECT id, name, price_cents, stock FROM products").fetchall()
    kind = rng.choice(["order", "email", "order_then_cancel"])
    cid, name, balance = rng.choice(customers)
    if kind == "email":
        email = f"{name.split()[0].lower()}{rng.randrange(100)}@mail.test"
        return ShopTask(seed, f"{name} wants the email on file changed to {email}.",
                        [("update_email", {"customer_id": cid, "email": email})])
    affordable = [p for p in products if p[3] >= 1 and p[2] <= balance]
    if not affordable:
        return make_task(seed + 1_000_003)
    pid, product, price, stock = rng.choice(affordable)
    qty = max(q for q in range(1, stock + 1) if q * price <= balance) if kind == "order" else 1
    order = [("place_order", {"customer_id": cid, "product_id": pid, "quantity": qty})]
    if kind == "order":
        return ShopTask(seed, f"{name} would like to buy {qty} {product}(s). Place the order.",
                        order)
    order_id = db.execute("SELECT max(id) FROM orders").fetchone()[0] + 1
    return ShopTask(seed, f"{name} orders one {product}, then changes their mind: place the "
                    "order, then cancel it.", order + [("cancel_order", {"order_id": order_id})])


class ShopEnvironment:
    """One episode: a fresh database for the task, its tools, and the final-state grader."""

    def __init__(self, task: ShopTask) -> None:
        self.task = task
        self.db = make_database(task.seed)
        self.tools = shop_tools(self.db)

    def expected_state(self) -> dict[str, list[tuple]]:
        db = make_database(self.task.seed)
        tools = shop_tools(db)
        for name, args in self.task.reference:
            result = tools(ToolCall(name, args))
            if not result.ok:
                raise ValueError(f"reference call {name}({args}) fails: {result.output}")
        return dump(db)

    def grade(self) -> Grade:
        want, got = self.expected_state(), dump(self.db)
        wrong = [t for t in want if want[t] != got.get(t)]
        if wrong:
            return Grade(0.0, f"final state differs in tables {wrong}")
        return Grade(1.0, "final state matches the task's goal")
