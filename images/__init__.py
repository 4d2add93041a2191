"""Container images Orchard uses: one folder per image definition, and the code to build them."""
