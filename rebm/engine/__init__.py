"""The one training engine for every stage: loop, parts, tracking, EMA, metrics window."""
