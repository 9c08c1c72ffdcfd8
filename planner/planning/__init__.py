"""Planning a whole train step: the levers composed, hand configurations evaluated and compared."""
