"""DomainBed experiments with PGrad (see experiments/README.md)."""
