"""Pure decisions: tiers, sleep and wake, scaling, status, heat, the children's builders and
demand forecasting.  No I/O, no clock of their own (callers pass ``now``), no settings read
behind the caller's back: everything a rule needs comes in as an argument."""
