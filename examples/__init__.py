"""Demo task types of dtq (contract section 14); ``examples.tasks`` is the default task module."""
