"""A FastAPI app that submits a task and awaits its result (``app.py``), its task
(``tasks.py``), and the tests a user would write for both (``test_thumbnails.py``,
docs/testing.md)."""
