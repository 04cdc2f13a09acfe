"""The suite's order: the tests that start processes of their own (the long ones) first, so that pytest-xdist's two
workers share them from the start and end together, instead of one running a long test alone at the end."""


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("subprocess") is None)  # (stable: file order within each)
