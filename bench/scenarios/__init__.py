"""One module per scenario; each has ``async def run(env) -> list[Result]``."""
