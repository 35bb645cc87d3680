"""A discrete-event fleet simulator driven by the router's and facilities' own policies."""
