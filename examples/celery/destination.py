"""The celery example's destination: the ledger on 127.0.0.1:9100.

python3 -m examples.celery.destination
"""

from examples.ledger import main

if __name__ == "__main__":
    main()
