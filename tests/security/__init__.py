"""System mode: a root daemon, real Unix users, hostile input, containment."""
