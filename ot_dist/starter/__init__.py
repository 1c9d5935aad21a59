"""`ot-dist init`: a commented starting config chosen from the memory table for the user's GPUs."""
