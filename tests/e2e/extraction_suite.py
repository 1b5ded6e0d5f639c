"""25 real-world extraction tasks: a JSON schema, an input document, and the gold extraction.

Every schema is bounded (maxLength on free strings, maxItems on arrays, bounds on numbers, patterns with
bounded repetitions) the way a production extraction schema would be, so a complete answer always fits in
MAX_NEW_TOKENS. The gold
object validates against its schema (checked by tests/e2e/test_constrained.py) and its string values are
copied from the document. Used by tests/e2e/test_constrained.py and benchmarks/bench_constrained.py.
"""

from __future__ import annotations

import datetime
import json
import re
from typing import Any, NamedTuple

import jsonschema

MAX_NEW_TOKENS = 320
SYSTEM = "You are a precise information extraction system. Answer with JSON only."


class Case(NamedTuple):
    name: str
    schema: dict[str, Any]
    text: str
    gold: dict[str, Any]


def s(max_length: int = 60, **kw: Any) -> dict[str, Any]:
    """A bounded free-text string."""
    return {"type": "string", "maxLength": max_length, **kw}


def integer(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def number(lo: float, hi: float) -> dict[str, Any]:
    return {"type": "number", "minimum": lo, "maximum": hi}


def obj(props: dict[str, Any], required: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


def array(items: dict[str, Any], max_items: int, min_items: int = 0) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


DATE = {"type": "string", "format": "date"}
DATE_TIME = {"type": "string", "format": "date-time"}
# An email with bounded parts: `"format": "email"` leaves the length open, and a small model can loop
# inside an address ("billing.billing.billing...") until max_new_tokens.
EMAIL = {"type": "string",
         "pattern": r"^[A-Za-z0-9._%+-]{1,40}@[A-Za-z0-9-]{1,30}(\.[A-Za-z0-9-]{1,20}){1,3}$"}
UUID = {"type": "string", "format": "uuid"}
ADDRESS_DEFS = {"address": obj({
    "street": s(60), "city": s(40), "postal_code": {"type": "string", "pattern": "^[0-9A-Z -]{3,10}$"},
    "country": s(40),
})}
ADDRESS_REF = {"$ref": "#/$defs/address"}


CASES: list[Case] = [
    Case(
        "invoice",
        obj({
            "invoice_number": {"type": "string", "pattern": "^INV-[0-9]{4,6}$"},
            "issue_date": DATE,
            "due_date": DATE,
            "vendor": obj({"name": s(60), "email": EMAIL}),
            "line_items": array(obj({"description": s(60), "quantity": integer(1, 1000),
                                     "unit_price": number(0, 100000)}), 5, 1),
            "total": number(0, 1000000),
            "currency": {"enum": ["USD", "EUR", "GBP"]},
        }),
        "Invoice INV-20931 from Northwind Traders (billing@northwind.com), issued on 2024-03-05 and due "
        "2024-04-04. Items: 3 x Ergonomic chair at 245.00 each; 2 x Standing desk at 480.50 each. "
        "Total due: 1696.00 EUR.",
        {"invoice_number": "INV-20931", "issue_date": "2024-03-05", "due_date": "2024-04-04",
         "vendor": {"name": "Northwind Traders", "email": "billing@northwind.com"},
         "line_items": [{"description": "Ergonomic chair", "quantity": 3, "unit_price": 245.0},
                        {"description": "Standing desk", "quantity": 2, "unit_price": 480.5}],
         "total": 1696.0, "currency": "EUR"},
    ),
    Case(
        "person",
        obj({"full_name": s(50), "age": integer(0, 120), "email": EMAIL,
             "phone": {"type": "string", "pattern": "^\\+?[0-9 ()-]{7,20}$"}, "city": s(40)},
            required=["full_name", "age", "city"]),
        "Maria Gonzalez, 34, moved to Barcelona last spring. You can reach her at maria.gonzalez@example.org "
        "or by phone on +34 612 345 678.",
        {"full_name": "Maria Gonzalez", "age": 34, "email": "maria.gonzalez@example.org",
         "phone": "+34 612 345 678", "city": "Barcelona"},
    ),
    Case(
        "product_catalog",
        obj({"products": array(obj({
            "name": s(50), "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3,5}$"},
            "price": number(0, 10000), "in_stock": {"type": "boolean"},
            "tags": array({"enum": ["audio", "wireless", "kitchen", "outdoor", "office"]}, 3),
        }), 4, 1)}),
        "New this week: the AirBeat wireless earbuds (SKU AUD-1042) for 79.99, in stock; the TrailLite "
        "camping stove (SKU OUT-377) for 54.50, currently sold out.",
        {"products": [
            {"name": "AirBeat wireless earbuds", "sku": "AUD-1042", "price": 79.99, "in_stock": True,
             "tags": ["audio", "wireless"]},
            {"name": "TrailLite camping stove", "sku": "OUT-377", "price": 54.5, "in_stock": False,
             "tags": ["outdoor", "kitchen"]},
        ]},
    ),
    Case(
        "shipping_addresses",
        {"$defs": ADDRESS_DEFS, **obj({"customer": s(50), "billing": ADDRESS_REF, "shipping": ADDRESS_REF})},
        "Customer: Jonas Becker. Bill to Hauptstrasse 12, Berlin, 10115, Germany. Ship to Marienplatz 8, "
        "Munich, 80331, Germany.",
        {"customer": "Jonas Becker",
         "billing": {"street": "Hauptstrasse 12", "city": "Berlin", "postal_code": "10115",
                     "country": "Germany"},
         "shipping": {"street": "Marienplatz 8", "city": "Munich", "postal_code": "80331",
                      "country": "Germany"}},
    ),
    Case(
        "calendar_event",
        obj({"title": s(60), "start": DATE_TIME, "end": DATE_TIME, "location": s(60),
             "attendees": array(s(40), 6)}),
        "Quarterly planning review on 2024-06-12 from 09:30 to 11:00 (UTC), in Conference Room B. "
        "Attendees: Priya Shah, Tom Lee, Ana Costa.",
        {"title": "Quarterly planning review", "start": "2024-06-12T09:30:00Z", "end": "2024-06-12T11:00:00Z",
         "location": "Conference Room B", "attendees": ["Priya Shah", "Tom Lee", "Ana Costa"]},
    ),
    Case(
        "job_posting",
        obj({"title": s(60), "company": s(50),
             "employment_type": {"enum": ["full-time", "part-time", "contract", "internship"]},
             "salary_min": integer(0, 1000000), "salary_max": integer(0, 1000000),
             "remote": {"type": "boolean"},
             "skills": array(s(30), 6)}),
        "Acme Robotics is hiring a Senior Backend Engineer (full-time, fully remote). Salary range "
        "140000 to 175000 USD. Required skills: Python, PostgreSQL, Kubernetes.",
        {"title": "Senior Backend Engineer", "company": "Acme Robotics", "employment_type": "full-time",
         "salary_min": 140000, "salary_max": 175000, "remote": True,
         "skills": ["Python", "PostgreSQL", "Kubernetes"]},
    ),
    Case(
        "recipe",
        obj({"name": s(60), "servings": integer(1, 50), "prep_minutes": integer(0, 600),
             "ingredients": array(obj({
                 "item": s(40), "amount": number(0, 5000),
                 "unit": {"enum": ["g", "ml", "cup", "tbsp", "tsp", "piece"]}}), 8, 1)}),
        "Classic pancakes, serves 4, ready in 20 minutes. You need 200 g flour, 300 ml milk, 2 piece eggs "
        "and 1 tbsp sugar.",
        {"name": "Classic pancakes", "servings": 4, "prep_minutes": 20, "ingredients": [
            {"item": "flour", "amount": 200, "unit": "g"}, {"item": "milk", "amount": 300, "unit": "ml"},
            {"item": "eggs", "amount": 2, "unit": "piece"}, {"item": "sugar", "amount": 1, "unit": "tbsp"}]},
    ),
    Case(
        "flight_booking",
        obj({"passenger": s(50), "flight_number": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"},
             "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
             "destination": {"type": "string", "pattern": "^[A-Z]{3}$"}, "departure": DATE_TIME,
             "seat": {"type": "string", "pattern": "^[0-9]{1,2}[A-F]$"},
             "cabin": {"enum": ["economy", "premium", "business", "first"]}}),
        "Booking confirmed for Kenji Watanabe: flight NH106 from LAX to HND departing 2024-09-01T13:45:00Z, "
        "seat 32K is unavailable so you are in seat 14C, business class.",
        {"passenger": "Kenji Watanabe", "flight_number": "NH106", "origin": "LAX", "destination": "HND",
         "departure": "2024-09-01T13:45:00Z", "seat": "14C", "cabin": "business"},
    ),
    Case(
        "medical_appointment",
        obj({"patient": s(50), "doctor": s(50), "date": DATE,
             "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
             "reason": s(80), "first_visit": {"type": "boolean"}}),
        "Reminder: Mr. David Okafor has a follow-up with Dr. Lena Fischer on 2024-11-18 at 14:15 to review "
        "his blood test results. This is not his first visit.",
        {"patient": "David Okafor", "doctor": "Lena Fischer", "date": "2024-11-18", "time": "14:15",
         "reason": "review his blood test results", "first_visit": False},
    ),
    Case(
        "bank_transactions",
        obj({"account_holder": s(50), "transactions": array(obj({
            "date": DATE, "amount": number(0, 1000000), "direction": {"enum": ["debit", "credit"]},
            "counterparty": s(50)}), 5, 1)}),
        "Statement for Olivia Brown. 2024-02-01: salary from Globex Corp, credit of 4200.00. 2024-02-03: "
        "debit of 89.99 to CityPower Utilities. 2024-02-07: debit of 1250.00 to Oakwood Apartments.",
        {"account_holder": "Olivia Brown", "transactions": [
            {"date": "2024-02-01", "amount": 4200.0, "direction": "credit",
             "counterparty": "Globex Corp"},
            {"date": "2024-02-03", "amount": 89.99, "direction": "debit",
             "counterparty": "CityPower Utilities"},
            {"date": "2024-02-07", "amount": 1250.0, "direction": "debit",
             "counterparty": "Oakwood Apartments"}]},
    ),
    Case(
        "support_ticket",
        obj({"ticket_id": UUID, "customer_email": EMAIL,
             "priority": {"enum": ["low", "medium", "high", "urgent"]},
             "category": {"enum": ["billing", "technical", "account", "shipping"]}, "summary": s(100)}),
        "Ticket 3f2b8c1e-9a4d-4e6b-8f0a-2c7d5e9b1a34 opened by sam.taylor@mailbox.net: I was charged twice "
        "for my March subscription. Please refund one payment. Marked as high priority billing issue.",
        {"ticket_id": "3f2b8c1e-9a4d-4e6b-8f0a-2c7d5e9b1a34", "customer_email": "sam.taylor@mailbox.net",
         "priority": "high", "category": "billing", "summary": "charged twice for my March subscription"},
    ),
    Case(
        "movie_review",
        obj({"title": s(60), "year": integer(1888, 2030), "rating": number(0, 10),
             "sentiment": {"enum": ["positive", "negative", "mixed"]},
             "pros": array(s(60), 3), "cons": array(s(60), 3)}),
        "Review: 'The Silent Harbor' (2019). Gorgeous cinematography and a haunting score, but the second "
        "half drags. I give it 7.5 out of 10.",
        {"title": "The Silent Harbor", "year": 2019, "rating": 7.5, "sentiment": "mixed",
         "pros": ["Gorgeous cinematography", "haunting score"], "cons": ["the second half drags"]},
    ),
    Case(
        "company_profile",
        {"$defs": ADDRESS_DEFS, **obj({"name": s(60), "founded": integer(1600, 2030), "ceo": s(50),
                                        "employees": integer(1, 5000000), "headquarters": ADDRESS_REF})},
        "Helios Energy was founded in 1998 and employs 12500 people. Its CEO is Hannah Lindqvist and its "
        "headquarters are at Kungsgatan 44, Stockholm, 111 35, Sweden.",
        {"name": "Helios Energy", "founded": 1998, "ceo": "Hannah Lindqvist", "employees": 12500,
         "headquarters": {"street": "Kungsgatan 44", "city": "Stockholm", "postal_code": "111 35",
                          "country": "Sweden"}},
    ),
    Case(
        "preferred_contact",
        obj({"name": s(50), "contact": {"oneOf": [
            obj({"method": {"const": "email"}, "address": EMAIL}),
            obj({"method": {"const": "phone"},
                 "number": {"type": "string", "pattern": "^\\+?[0-9 -]{7,20}$"}}),
        ]}}),
        "Please contact Arjun Mehta by email only: arjun.mehta@finlabs.io. He does not answer his phone.",
        {"name": "Arjun Mehta", "contact": {"method": "email", "address": "arjun.mehta@finlabs.io"}},
    ),
    Case(
        "package_tracking",
        obj({"tracking_number": {"type": "string", "pattern": "^[A-Z0-9]{10,22}$"},
             "carrier": {"enum": ["UPS", "FedEx", "DHL", "USPS"]},
             "status": {"enum": ["label_created", "in_transit", "out_for_delivery", "delivered",
                                 "exception"]},
             "estimated_delivery": DATE,
             "history": array(obj({"date": DATE, "location": s(50)}), 4)}),
        "Your DHL parcel 1Z999AA10123456784 is in transit. Scanned in Leipzig on 2024-05-02 and in Paris on "
        "2024-05-03. Estimated delivery 2024-05-06.",
        {"tracking_number": "1Z999AA10123456784", "carrier": "DHL", "status": "in_transit",
         "estimated_delivery": "2024-05-06",
         "history": [{"date": "2024-05-02", "location": "Leipzig"},
                     {"date": "2024-05-03", "location": "Paris"}]},
    ),
    Case(
        "real_estate_listing",
        {"$defs": ADDRESS_DEFS, **obj({
            "address": ADDRESS_REF, "price": integer(0, 100000000), "bedrooms": integer(0, 20),
            "bathrooms": number(0, 20), "area_sqm": integer(10, 100000), "features": array(s(40), 6)})},
        "For sale: bright apartment at 221 Baker Street, London, NW1 6XE, United Kingdom. 3 bedrooms, "
        "1.5 bathrooms, 96 square meters, with balcony and parking. Asking price 895000.",
        {"address": {"street": "221 Baker Street", "city": "London", "postal_code": "NW1 6XE",
                     "country": "United Kingdom"},
         "price": 895000, "bedrooms": 3, "bathrooms": 1.5, "area_sqm": 96,
         "features": ["balcony", "parking"]},
    ),
    Case(
        "meeting_actions",
        obj({"date": DATE, "attendees": array(s(40), 4), "decisions": array(s(60), 2),
             "action_items": array(obj({"owner": s(40), "task": s(60),
                                        "due": {"anyOf": [DATE, {"type": "null"}]}}), 3)}),
        "Meeting 2024-07-09 with Chen Wei, Laura Smith and Omar Haddad. Decided to postpone the launch to "
        "September. Actions: Laura Smith will update the roadmap by 2024-07-16; Omar Haddad will contact the "
        "vendor (no deadline).",
        {"date": "2024-07-09", "attendees": ["Chen Wei", "Laura Smith", "Omar Haddad"],
         "decisions": ["postpone the launch to September"],
         "action_items": [{"owner": "Laura Smith", "task": "update the roadmap", "due": "2024-07-16"},
                          {"owner": "Omar Haddad", "task": "contact the vendor", "due": None}]},
    ),
    Case(
        "book_metadata",
        obj({"title": s(80), "authors": array(s(50), 4, 1),
             "isbn": {"type": "string", "pattern": "^97[89][0-9]{10}$"},
             "published_year": integer(1450, 2030),
             "genres": array({"enum": ["fiction", "science", "history", "biography", "fantasy", "mystery"]},
                             3)}),
        "The Clockmaker's Daughter by Eleanor Vance, published in 2017 (ISBN 9781250123459), is a historical "
        "mystery set in 19th-century Prague.",
        {"title": "The Clockmaker's Daughter", "authors": ["Eleanor Vance"], "isbn": "9781250123459",
         "published_year": 2017, "genres": ["history", "mystery"]},
    ),
    Case(
        "vehicle",
        obj({"make": s(30), "model": s(30), "year": integer(1900, 2030),
             "vin": {"type": "string", "pattern": "^[A-HJ-NPR-Z0-9]{17}$"}, "mileage_km": integer(0, 2000000),
             "fuel": {"enum": ["petrol", "diesel", "hybrid", "electric"]}}),
        "Used 2018 Toyota Corolla hybrid, 64200 km, VIN JTDKBRFU9J3012345, one owner, full service history.",
        {"make": "Toyota", "model": "Corolla", "year": 2018, "vin": "JTDKBRFU9J3012345", "mileage_km": 64200,
         "fuel": "hybrid"},
    ),
    Case(
        "weather_report",
        obj({"city": s(40), "date": DATE, "temperature_c": number(-90, 60),
             "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "storm", "fog"]},
             "wind_kph": number(0, 400), "humidity_pct": integer(0, 100)}),
        "Weather for Oslo on 2024-01-15: snow all day, temperature -7.5 C, wind 22 km/h, humidity 85%.",
        {"city": "Oslo", "date": "2024-01-15", "temperature_c": -7.5, "conditions": "snow", "wind_kph": 22,
         "humidity_pct": 85},
    ),
    Case(
        "api_order",
        obj({"api_version": {"const": "v2"}, "order_id": UUID,
             "customer": obj({"name": s(50), "email": EMAIL}),
             "items": array(obj({"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
                                 "quantity": integer(1, 100)}), 5, 1),
             "status": {"enum": ["pending", "paid", "shipped", "cancelled"]}}),
        "Order 9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d placed by Emma Wilson (emma.wilson@shopmail.com): "
        "2 units of KB1204 and 1 unit of MS0077. Payment received.",
        {"api_version": "v2", "order_id": "9b1deb4d-3b7d-4bad-9bdd-2b0d7b3dcb6d",
         "customer": {"name": "Emma Wilson", "email": "emma.wilson@shopmail.com"},
         "items": [{"sku": "KB1204", "quantity": 2}, {"sku": "MS0077", "quantity": 1}], "status": "paid"},
    ),
    Case(
        "research_paper",
        obj({"title": s(100), "authors": array(obj({"name": s(50), "affiliation": s(60)}), 4, 1),
             "year": integer(1900, 2030), "venue": s(40), "keywords": array(s(30), 5)}),
        "'Sparse Attention for Long Documents' by Ravi Patel (University of Toronto) and Mei Lin "
        "(ETH Zurich), presented at NeurIPS 2023. Keywords: transformers, sparsity, long context.",
        {"title": "Sparse Attention for Long Documents",
         "authors": [{"name": "Ravi Patel", "affiliation": "University of Toronto"},
                     {"name": "Mei Lin", "affiliation": "ETH Zurich"}],
         "year": 2023, "venue": "NeurIPS", "keywords": ["transformers", "sparsity", "long context"]},
    ),
    Case(
        "restaurant_reservation",
        obj({"name": s(50), "party_size": integer(1, 20), "date": DATE,
             "time": {"type": "string", "pattern": "^([01][0-9]|2[0-3]):[0-5][0-9]$"},
             "special_requests": {"anyOf": [s(80), {"type": "null"}]}}),
        "Table for 6 under the name Lucas Moreau on 2024-12-24 at 19:30. They need a high chair for a baby.",
        {"name": "Lucas Moreau", "party_size": 6, "date": "2024-12-24", "time": "19:30",
         "special_requests": "a high chair for a baby"},
    ),
    Case(
        "match_result",
        obj({"home_team": s(40), "away_team": s(40), "home_score": integer(0, 200),
             "away_score": integer(0, 200),
             "date": DATE, "venue": s(50), "outcome": {"enum": ["home_win", "away_win", "draw"]}}),
        "On 2024-04-20 at Riverside Stadium, the Harbor City Sharks beat the visiting Mountain Eagles "
        "3 to 1.",
        {"home_team": "Harbor City Sharks", "away_team": "Mountain Eagles", "home_score": 3, "away_score": 1,
         "date": "2024-04-20", "venue": "Riverside Stadium", "outcome": "home_win"},
    ),
    Case(
        "bug_report",
        obj({"id": {"type": "string", "pattern": "^BUG-[0-9]{1,6}$"},
             "severity": {"enum": ["trivial", "minor", "major", "critical"]}, "component": s(40),
             "version": {"type": "string", "pattern": "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}$"},
             "steps": array(s(80), 5), "reproducible": {"type": "boolean"}}),
        "BUG-4821 (critical) in the payment gateway, version 2.14.3: open the checkout page, enter a "
        "card, press Pay; the page freezes. Happens every time.",
        {"id": "BUG-4821", "severity": "critical", "component": "payment gateway", "version": "2.14.3",
         "steps": ["open the checkout page", "enter a card", "press Pay"], "reproducible": True},
    ),
]


def field_hint(schema: dict[str, Any]) -> str:
    return ", ".join(schema.get("properties", {}))


def messages(case: Case) -> list[dict[str, str]]:
    """The chat for one case: the document and the top-level fields; the grammar enforces the rest."""
    task = case.name.replace("_", " ")
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Extract the {task} from the text below as JSON with the fields "
                                    f"{field_hint(case.schema)}.\n\nText: {case.text}"},
    ]


def leaves(value: Any, path: str = "") -> dict[str, Any]:
    """JSON pointer -> scalar, for comparing an extraction with the gold one field by field."""
    if isinstance(value, dict):
        return {k: v for key, sub in value.items() for k, v in leaves(sub, f"{path}/{key}").items()}
    if isinstance(value, list):
        return {k: v for i, sub in enumerate(value) for k, v in leaves(sub, f"{path}/{i}").items()}
    return {path: value}


def schema_json(case: Case) -> str:
    return json.dumps(case.schema)


FORMAT_CHECKER = jsonschema.FormatChecker()  # date, email, uuid, ...; date-time needs an extra package:


@FORMAT_CHECKER.checks("date-time", raises=ValueError)
def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not re.fullmatch(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)", value):
        return False
    datetime.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))  # ValueError: no such date
    return True
